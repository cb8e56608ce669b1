"""Every failure the client sees, in OpenAI's shape: {"error": {message, type, param, code}}.

Handlers raise `ApiError`; the error middleware (server/launch/app.py) turns it, an
engine refusal, an aiohttp HTTP error or anything unexpected into that body, so
no traceback ever reaches a client.
"""

from __future__ import annotations

import re

import msgspec
from msgspec import Struct

from kvfork.server.engine.api import EngineError


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Struct):
    error: ErrorDetail


# The `type` OpenAI's clients expect for each status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """`retry_after`: seconds after which the request may succeed (a 429's Retry-After header)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after

    def body(self) -> ErrorBody:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorBody(ErrorDetail(message=self.message, type=kind, param=self.param, code=self.code))


def client_text(value: object, limit: int = 64) -> str:
    """A client's string as a log line or an error message may hold it: escaped (no newline can forge a
    line, no control byte reaches a terminal), quoted, and cut to `limit` characters with the length said."""
    text = value if isinstance(value, str) else repr(value)
    shown = text[:limit].encode("unicode_escape").decode("ascii").replace("'", "\\'")
    return f"'{shown}'" + (f"... ({len(text):,} characters)" if len(text) > limit else "")


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="unsupported_parameter", param=param)


def from_engine(error: EngineError) -> ApiError:
    return ApiError(error.status, error.message, code=error.code)


_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def from_decode(error: msgspec.MsgspecError) -> ApiError:
    """A body that does not decode: name the offending field, as OpenAI does."""
    text = str(error)
    if isinstance(error, msgspec.ValidationError):
        at, missing = _AT_PATH.search(text), _MISSING.search(text)
        path = at.group(1) if at else ""
        if missing:
            path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return ApiError(400, text, code="invalid_value", param=path or None)
    return ApiError(400, f"the body is not valid JSON: {text}", code="invalid_json")
