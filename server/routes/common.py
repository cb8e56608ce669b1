"""What the OpenAI routes share: reading a body, the usage block."""

from __future__ import annotations

import msgspec
from aiohttp import web

from server.engine.api import Usage
from server.errors import ApiError, from_decode
from server.protocol.openai import PromptTokensDetails, UsageInfo, encoder


def decoder(kind: type) -> msgspec.json.Decoder:
    """Built when a route module loads, so a type msgspec cannot decode fails at import, not per request."""
    return msgspec.json.Decoder(kind)


async def read_body(request: web.Request, decode: msgspec.json.Decoder):
    raw = await request.read()  # over --max-body-bytes: aiohttp raises 413 here
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return decode.decode(raw)
    except msgspec.MsgspecError as e:
        raise from_decode(e) from None


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.generated_tokens,
        total_tokens=usage.prompt_tokens + usage.generated_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.reused_tokens),
    )


def json_response(body, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encoder.encode(body), content_type="application/json")
