"""The aiohttp application: routes, the error and auth middlewares, and how it listens.

Disconnects: aiohttp leaves a handler running when its client goes away unless
the runner is built with `handler_cancellation=True`. `listen` always builds it
so: a lost connection cancels the handler at once, wherever it waits (queued,
prefilling, streaming), and the handler's `generation` block cancels the engine
request on the way out. Tests listen through the same function.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from server.engine.api import EngineError
from server.errors import ApiError, from_engine
from server.api.messages.protocol import error_body
from server.api.chat import route as chat
from server.api.completions import route as completions
from server.api.messages import route as messages
from server.api.responses import route as responses
from server.routes import loads, models, sessions
from server.api.respond import dropped_tools_header, json_response
from server.api.sse import CLIENT_GONE
from server.state import STATE, TENANT, AppState
from server.tenants import key_tenant

log = logging.getLogger("kvfork.http")

# Under /v1 yet open with --api-key, as /health and /metrics are: a gateway in front of replicas (smg) reads
# them with no client's key, to classify and register a replica (/v1/models: the served names, as llama.cpp's
# server leaves it open) and to poll its load (/v1/loads: nothing /metrics does not say). Neither names a
# tenant, a session or a prompt; every route that computes or stores still needs a key.
OPEN_PATHS = frozenset({models.PATH, loads.PATH})
CLIENT_CLOSED = "499"  # nginx's "client closed request", for the metrics
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def _error_response(error: ApiError, path: str) -> web.Response:
    """The error in the shape of the API the path belongs to: Anthropic's on /v1/messages, else OpenAI's."""
    if path.startswith(messages.PATH):
        return web.Response(status=error.status, body=error_body(error.status, error.message),
                            content_type="application/json")
    return json_response(error.body(), status=error.status)


def _api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EngineError):
        return from_engine(e)
    if isinstance(e, web.HTTPException):
        return ApiError(e.status, e.reason if e.status != 413 else e.text or e.reason,
                        code=_HTTP_CODES.get(e.status, f"http_{e.status}"))
    log.exception("unexpected error")  # the log keeps the traceback; the client gets none
    return ApiError(500, "internal error", code="internal_error")


def _middlewares(state: AppState, requests_total) -> list:
    @web.middleware
    async def errors(request: web.Request, handler):
        resource = request.match_info.route.resource
        route = resource.canonical if resource else "unmatched"
        try:
            response = await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = _error_response(_api_error(e), request.path)
        except ApiError as e:
            response = _error_response(e, request.path)
        except asyncio.CancelledError:  # the client went away (handler_cancellation)
            requests_total.inc(route=route, status=CLIENT_CLOSED)
            raise
        except ConnectionError:  # the client went away under a write; answering is moot, aiohttp drops it
            request[CLIENT_GONE] = True
            response = web.Response(status=499)
        except Exception as e:
            response = _error_response(_api_error(e), request.path)
        requests_total.inc(route=route, status=CLIENT_CLOSED if request.get(CLIENT_GONE) else str(response.status))
        return response

    @web.middleware
    async def auth(request: web.Request, handler):
        if state.keys and request.path.startswith("/v1/") and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            given = given or request.headers.get("x-api-key", "")
            tenant = key_tenant(state.keys, given)
            if tenant is None:
                raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
            request[TENANT] = tenant
        return await handler(request)

    return [errors, auth]


async def _response_headers(request: web.Request, response: web.StreamResponse) -> None:
    dropped_tools_header(request, response)


async def _root(request: web.Request) -> web.Response:
    """GET and HEAD /: a reachability probe (Claude Code sends HEAD / before its first request)."""
    return web.Response(text="kvfork\n")


def build_app(state: AppState) -> web.Application:
    requests_total = state.registry.counter("http_requests_total", "HTTP requests answered, by route and status")
    app = web.Application(middlewares=_middlewares(state, requests_total), client_max_size=state.config.max_body_bytes)
    app[STATE] = state
    app.on_response_prepare.append(_response_headers)
    app.router.add_post("/v1/chat/completions", chat.handle)
    app.router.add_post("/v1/completions", completions.handle)
    app.router.add_post(messages.PATH, messages.handle)
    app.router.add_post(responses.PATH, responses.handle)
    app.router.add_get(responses.PATH + "/{response_id}", responses.retrieve)
    app.router.add_delete(responses.PATH + "/{response_id}", responses.delete)
    app.router.add_post(messages.PATH + "/count_tokens", messages.count_tokens)
    app.router.add_get(models.PATH, models.list_models)
    app.router.add_get("/", _root)  # HEAD too
    app.router.add_get("/health", models.health)
    app.router.add_get("/metrics", models.metrics)
    app.router.add_get(loads.PATH, loads.handle)
    app.router.add_post("/v1/sessions/{session_id}/reset", sessions.reset)
    app.router.add_delete("/v1/sessions/{session_id}", sessions.delete)
    return app


async def listen(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (to clean up) and the port bound (port 0 picks one)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]
