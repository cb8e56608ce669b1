"""GET /debug/reuse (the reuse page's JSON: server/watch/reuse.py) and GET / (the page to a browser, a plain
`kvfork` to a probe: Claude Code sends HEAD / before its first request).

Who sees what: with no keys at all, anyone on the listener (loopback by default) sees everything;
with --metrics-key, its holder sees every tenant's requests (by id and scope digest, never a name);
with --api-key, a tenant's key sees that tenant's alone. Anyone else gets 401. The page itself holds
no data: it reads the JSON from its own origin, with the key given in the page address's fragment
(`/#key=KEY`: a fragment never leaves the browser) when one is needed.
"""

from __future__ import annotations

from aiohttp import web

from kvfork.server.api.respond import json_response
from kvfork.server.common.state import holds_metrics_key, services_of
from kvfork.server.guard.errors import ApiError
from kvfork.server.guard.tenants import request_key
from kvfork.server.routes.reuse_page import PAGE

PATH = "/debug/reuse"


def caller_tenant(request: web.Request) -> str | None:
    """The tenant whose requests the caller may see; None: every tenant's."""
    services = services_of(request)
    if holds_metrics_key(request):
        return None
    given = request_key(request.headers.get("Authorization"), request.headers.get("x-api-key"))
    if services.keys:
        tenant = services.keys.tenant(given)
        if tenant is not None:
            return tenant
    if services.keys or services.metrics_keys:
        raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
    return None


async def handle(request: web.Request) -> web.Response:
    services = services_of(request)
    response = json_response(services.reuse.view(services.current().engine, caller_tenant(request)))
    response.headers["Cache-Control"] = "no-store"
    return response


async def root(request: web.Request) -> web.Response:
    """GET and HEAD /: the page to a browser (it asks for text/html), a plain answer to anyone else."""
    if "text/html" in request.headers.get("Accept", ""):
        return web.Response(text=PAGE, content_type="text/html",
                            headers={"Cache-Control": "no-store", "Content-Security-Policy": CSP,
                                     "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})
    return web.Response(text="kvfork\n")


# The page runs only its own inline script and reads only its own origin.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
