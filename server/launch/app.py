"""The aiohttp application: routes, the error and auth middlewares, and how it listens.

Disconnects: aiohttp leaves a handler running when its client goes away unless
the runner is built with `handler_cancellation=True`. `listen` always builds it
so: a lost connection cancels the handler at once, wherever it waits (queued,
prefilling, streaming), and the handler's `generation` block cancels the engine
request on the way out. Tests listen through the same function. Each connection
is watched for slow clients (server/guard/slow_clients.py), who are disconnected so.
"""

from __future__ import annotations

import asyncio
import logging
import math

import msgspec
from aiohttp import web

from kvfork.server.api.chat import route as chat
from kvfork.server.api.completions import route as completions
from kvfork.server.api.diagnosis import FINGERPRINTS, Fingerprints
from kvfork.server.api.messages import route as messages
from kvfork.server.api.messages.protocol import error_body
from kvfork.server.api.respond import dropped_tools_header, json_response, DROPPED_TOOLS_HEADER
from kvfork.server.api.responses import route as responses
from kvfork.server.api.responses.store import RESPONSES, ResponseStore
from kvfork.server.api.sse import CLIENT_GONE, OPENED
from kvfork.server.common.state import SERVICES, TENANT, Services
from kvfork.server.engine.api import EngineError
from kvfork.server.guard.errors import ApiError, from_engine
from kvfork.server.guard.origin_guard import cors_headers, is_preflight, preflight
from kvfork.server.guard.refusals import PAUSE_S, RefusalLimiter
from kvfork.server.guard.slow_clients import Watchdog, listen as watched_listen
from kvfork.server.guard.tenants import request_key
from kvfork.server.pool.pool import ModelPool
from kvfork.server.routes import loads, models, reuse, sessions

log = logging.getLogger("kvfork.http")

# Under /v1 yet open with --api-key, as /health and /metrics are: a gateway in front of replicas (smg) reads
# them with no client's key, to classify and register a replica (/v1/models: the served names, as llama.cpp's
# server leaves it open) and to poll its load (/v1/loads: nothing /metrics does not say). Neither names a
# tenant, a session or a prompt; every route that computes or stores still needs a key.
OPEN_PATHS = frozenset({models.PATH, loads.PATH})
CLIENT_CLOSED = "499"  # nginx's "client closed request", for the metrics
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
METRICS = "/metrics"
# One line per request (--access-log): client address, request line, status, response bytes, seconds.
ACCESS_LOG = logging.getLogger("kvfork.access")
ACCESS_FORMAT = '%a "%r" %s %b %Tf'


def _error_response(error: ApiError, path: str) -> web.Response:
    """The error in the shape of the API the path belongs to: Anthropic's on /v1/messages, else OpenAI's."""
    if path.startswith(messages.PATH):
        response = web.Response(status=error.status, body=error_body(error.status, error.message),
                                content_type="application/json")
    else:
        response = json_response(error.body(), status=error.status)
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    return response


async def _error_reply(error: ApiError, request: web.Request) -> web.StreamResponse:
    """`_error_response`, or, where the request's stream opened before its reply (a streaming request that waited
    for its model: server/pool/keepalive.py), the error inside that stream in the API's shape: Anthropic's error
    event on /v1/messages, else OpenAI's error frame and [DONE]."""
    response = request.get(OPENED)
    if response is None:
        return _error_response(error, request.path)
    if request.path.startswith(messages.PATH):
        frame = b"event: error\ndata: " + error_body(error.status, error.message) + b"\n\n"
    else:
        frame = b"data: " + msgspec.json.encode(error.body()) + b"\n\ndata: [DONE]\n\n"
    try:
        await response.write(frame)
        await response.write_eof()
    except (ConnectionError, RuntimeError):  # the client went away, or the stream had ended already
        pass
    return response


def _api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EngineError):
        return from_engine(e)
    if isinstance(e, web.HTTPException):
        message = e.reason if e.status != 413 else f"{e.text or e.reason} (--max-body-bytes)"
        return ApiError(e.status, message, code=_HTTP_CODES.get(e.status, f"http_{e.status}"))
    log.exception("unexpected error")  # the log keeps the traceback; the client gets none
    return ApiError(500, "internal error", code="internal_error")


async def _slowed(limiter: RefusalLimiter, key: tuple[str, str]) -> None:
    """A client past its refusals waits, then gets a 429 (server/guard/refusals.py)."""
    if limiter.over(key):
        await asyncio.sleep(PAUSE_S)
        raise ApiError(429, "too many refused requests; slow down (--refusal-rate)", code="rate_limit_exceeded")


def _refusal_key(request: web.Request) -> tuple[str, str]:
    """Whose bucket a refusal draws from: the authenticated tenant's, else the client address's."""
    tenant = request.get(TENANT)
    return ("tenant", tenant) if tenant is not None else ("address", request.remote or "")


def _middlewares(services: Services, requests_total) -> list:
    limiter = RefusalLimiter(services.config.refusal_rate)

    @web.middleware
    async def errors(request: web.Request, handler):
        resource = request.match_info.route.resource
        route = resource.canonical if resource else "unmatched"
        watchdog = Watchdog.of(request)
        if watchdog is not None:
            watchdog.request_started()
        try:
            response = await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = await _error_reply(_api_error(e), request)
        except ApiError as e:
            response = await _error_reply(e, request)
        except asyncio.CancelledError:  # the client went away (handler_cancellation)
            requests_total.inc(route=route, status=CLIENT_CLOSED)
            raise
        except ConnectionError:  # the client went away under a write; answering is moot, aiohttp drops it
            request[CLIENT_GONE] = True
            response = web.Response(status=499)
        except Exception as e:
            response = await _error_reply(_api_error(e), request)
        finally:
            if watchdog is not None:
                watchdog.request_ended()
        if 400 <= response.status < 500 and response.status != 429:
            limiter.refused(_refusal_key(request))
        requests_total.inc(route=route, status=CLIENT_CLOSED if request.get(CLIENT_GONE) else str(response.status))
        return response

    @web.middleware
    async def origin_guard(request: web.Request, handler):
        services.origin_guard.check(request)  # before auth: a preflight carries no key
        if is_preflight(request):
            return preflight(request)
        return await handler(request)

    @web.middleware
    async def auth(request: web.Request, handler):
        path = request.path
        if (services.keys and path.startswith("/v1/") and path not in OPEN_PATHS) or \
                (services.config.metrics_key and path == METRICS):
            given = request_key(request.headers.get("Authorization"), request.headers.get("x-api-key"))
            tenant = (services.keys if path != METRICS else services.metrics_keys).tenant(given)
            if tenant is None:  # auth failures are counted by address: they slow the failing client alone
                await _slowed(limiter, _refusal_key(request))
                raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
            request[TENANT] = tenant
        await _slowed(limiter, _refusal_key(request))
        return await handler(request)

    return [errors, origin_guard, auth]


async def _response_headers(request: web.Request, response: web.StreamResponse) -> None:
    dropped_tools_header(request, response)
    cors_headers(request, response, DROPPED_TOOLS_HEADER)


def build_app(services: Services) -> web.Application:
    """The routes over `services`, with what two APIs keep for the daemon: /v1/responses' stored responses and
    the cache diagnostics' fingerprints."""
    config, registry = services.config, services.registry
    requests_total = registry.counter("http_requests_total", "HTTP requests answered, by route and status")
    # several models: a request's lease on its model is released after its answer (server/pool/pool.py)
    pool = [services.models.middleware] if isinstance(services.models, ModelPool) else []
    app = web.Application(middlewares=_middlewares(services, requests_total) + pool,
                          client_max_size=config.max_body_bytes)
    app[SERVICES] = services
    app[RESPONSES] = ResponseStore(config.max_stored_responses, services.forget_session,
                                   config.max_stored_response_bytes)
    app[FINGERPRINTS] = Fingerprints(registry)
    app.on_response_prepare.append(_response_headers)
    app.router.add_post("/v1/chat/completions", chat.handle)
    app.router.add_post("/v1/completions", completions.handle)
    app.router.add_post(messages.PATH, messages.handle)
    app.router.add_post(responses.PATH, responses.handle)
    app.router.add_get(responses.PATH + "/{response_id}", responses.retrieve)
    app.router.add_delete(responses.PATH + "/{response_id}", responses.delete)
    app.router.add_post(messages.PATH + "/count_tokens", messages.count_tokens)
    app.router.add_get(models.PATH, models.list_models)
    app.router.add_get("/", reuse.root)  # HEAD too
    app.router.add_get(reuse.PATH, reuse.handle)
    app.router.add_get("/health", models.health)
    app.router.add_get(METRICS, models.metrics)
    app.router.add_get(loads.PATH, loads.handle)
    app.router.add_post("/v1/sessions/{session_id}/reset", sessions.reset)
    app.router.add_delete("/v1/sessions/{session_id}", sessions.delete)
    return app


class Listener:
    """What `listen` started: the runner and its socket server, stopped together by `close`."""

    def __init__(self, runner: web.AppRunner, server: asyncio.Server):
        self.runner, self.server = runner, server
        self.port: int = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.server.close()  # no new connections; the runner then ends the open ones
        await self.runner.cleanup()


async def listen(app: web.Application, host: str, port: int) -> Listener:
    """Start serving (port 0 picks a free port: Listener.port)."""
    access = ACCESS_LOG if app[SERVICES].config.access_log else None
    # request bodies are decoded from their Content-Encoding by kvfork (api/content_encoding.py), not the parser
    runner = web.AppRunner(app, handler_cancellation=True, auto_decompress=False, access_log=access,
                           access_log_format=ACCESS_FORMAT)
    await runner.setup()
    return Listener(runner, await watched_listen(runner, host, port, app[SERVICES].clients))
