"""Named sessions: POST /v1/sessions/{id}/reset drops the held state, DELETE forgets the session."""

from __future__ import annotations

from aiohttp import web

from server.errors import ApiError
from server.sampling import session_id
from server.state import state_of


async def reset(request: web.Request) -> web.Response:
    return _answer(request, "reset", state_of(request).engine.reset_session)


async def delete(request: web.Request) -> web.Response:
    return _answer(request, "deleted", state_of(request).engine.delete_session)


def _answer(request: web.Request, verb: str, act) -> web.Response:
    state = state_of(request)
    state.require_ready()
    name = session_id(request.match_info["session_id"], None)
    if not act(name):  # SessionBusy raises: the middleware answers 409
        raise ApiError(404, f"no session named {name!r}", code="session_not_found", param="session_id")
    return web.json_response({"id": name, "object": "session", verb: True})
