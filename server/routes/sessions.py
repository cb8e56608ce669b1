"""Named sessions: POST /v1/sessions/{id}/reset drops the held state, DELETE forgets the session.
A session id names a session of the caller's tenant: another tenant's session of that id is not touched."""

from __future__ import annotations

from aiohttp import web

from kvfork.server.api.openai import SessionReply
from kvfork.server.api.prepare import session_id
from kvfork.server.api.respond import json_response
from kvfork.server.common.state import services_of, tenant_of
from kvfork.server.guard.errors import ApiError


async def reset(request: web.Request) -> web.Response:
    name = _known_session(request, lambda engine: engine.reset_session)
    return json_response(SessionReply(name, "session", reset=True))


async def delete(request: web.Request) -> web.Response:
    name = _known_session(request, lambda engine: engine.delete_session)
    return json_response(SessionReply(name, "session", deleted=True))


def _known_session(request: web.Request, verb) -> str:
    """Act on the session in every loaded model (one, unless the daemon serves several)."""
    services = services_of(request)
    services.current().require_ready()
    name = session_id(request.match_info["session_id"])
    found = [verb(engine)(name, tenant_of(request)) for engine in services.models.engines()]  # SessionBusy raises: 409
    if not any(found):
        raise ApiError(404, f"no session named {name!r}", code="session_not_found", param="session_id")
    return name
