"""The Origin and Host guard: a web page may not drive the daemon, unless the operator allows its origin.

A page any site serves can send a request to a daemon on the user's machine: a cross-site POST
with a `text/plain` or form body needs no CORS preflight, and a page whose name is re-pointed at
127.0.0.1 (DNS rebinding) reads the replies as its own. Three checks, on every request, keyed daemon
or not (a keyless one, the agents' default, has nothing else in the way):

- Host: the name the client reached the daemon by is a loopback name (localhost, *.localhost), an
  IP address (a rebinding page's Host is always its own domain name), the address the daemon
  listens on, this machine's name, or one of --allowed-hosts; else 403. A request with no Host
  (HTTP/1.0) is not a browser's.
- Origin: a request a browser sends from a page carries the page's origin; it must be the daemon's
  own (the Origin's host and port are the Host header's) or one of --allowed-origins; else 403.
  Real clients (the openai and anthropic SDKs, curl) send none.
- Content-Type: an API POST carries JSON. `text/plain` and `multipart/form-data` bodies are 415s; a
  form type is a 415 when it comes from a page (curl -d sends that type with a JSON body).

An allowed origin gets CORS: its preflight (OPTIONS) is answered, and every reply to it carries
Access-Control-Allow-Origin.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from functools import lru_cache

from aiohttp import web
from yarl import URL

from kvfork.server.guard.errors import ApiError

CORS_ORIGIN = web.RequestKey("cors_origin", str)  # Access-Control-Allow-Origin for a reply to an allowed origin
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_PAGE_ONLY_TYPES = frozenset({"text/plain", "multipart/form-data"})  # what browsers send without a preflight
_FORM = "application/x-www-form-urlencoded"
_ALLOW_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, OpenAI-Organization, " \
                 "OpenAI-Project, X-Kvfork-Session, x-stainless-os, x-stainless-lang, x-stainless-arch, " \
                 "x-stainless-runtime, x-stainless-runtime-version, x-stainless-package-version, " \
                 "x-stainless-retry-count, x-stainless-timeout"
_ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
_PREFLIGHT_MAX_AGE = "600"


@lru_cache(maxsize=1)
def _machine_names() -> frozenset[str]:
    names = {socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
    except OSError:
        pass
    return frozenset(n for n in names if n)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class OriginGuard:
    """The checks, as one daemon's flags set them."""

    listen_host: str
    allowed_hosts: frozenset[str]  # lowercase names; "*": any
    allowed_origins: frozenset[str]  # scheme://host[:port], lowercase; "*": any

    @staticmethod
    def of(listen_host: str, allowed_hosts: list[str], allowed_origins: list[str]) -> "OriginGuard":
        return OriginGuard(listen_host.lower(), frozenset(h.lower() for h in allowed_hosts),
                           frozenset(o.lower().rstrip("/") for o in allowed_origins))

    def host_allowed(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        return ("*" in self.allowed_hosts or name in _LOOPBACK_NAMES or name.endswith(".localhost")
                or _is_ip(name) or name == self.listen_host or name in self.allowed_hosts
                or name in _machine_names())

    def allowed_origin(self, origin: str) -> str | None:
        """What Access-Control-Allow-Origin says to `origin`: the operator's entry it matches (never the
        client's string), or None: not allowed."""
        normal = origin.lower().rstrip("/")
        return normal if normal in self.allowed_origins else "*" if "*" in self.allowed_origins else None

    def check(self, request: web.Request) -> None:
        """Raise the 403 or 415 a request gets; note the CORS origin a reply goes to."""
        host = request.headers.get("Host")
        if host is not None:
            name = URL(f"http://{host}").host if host else ""
            if not name or not self.host_allowed(name):
                raise ApiError(403, "the Host header names neither this machine nor an allowed name "
                               "(--allowed-hosts)", code="host_not_allowed")
        origin = request.headers.get("Origin")
        if origin is not None and not _same_origin(origin, host):
            allowed = self.allowed_origin(origin)
            if allowed is None:
                raise ApiError(403, "a request from another site's page is refused; allow its origin with "
                               "--allowed-origins", code="origin_not_allowed")
            request[CORS_ORIGIN] = allowed
        if request.method == "POST" and request.path.startswith("/v1/"):
            kind = request.content_type  # application/octet-stream when none is sent
            from_page = origin is not None or request.headers.get("Sec-Fetch-Site", "none") != "none"
            if kind in _PAGE_ONLY_TYPES or (kind == _FORM and from_page):
                raise ApiError(415, f"the body is JSON: send Content-Type: application/json, not {kind}",
                               code="unsupported_media_type")


def _same_origin(origin: str, host: str | None) -> bool:
    try:
        url = URL(origin)
    except ValueError:
        return False
    if host is None or url.scheme not in ("http", "https") or not url.host:
        return False  # "null" (a sandboxed page, a file): no site of ours
    return f"{url.host}:{url.port}".lower() == _host_port(host, url.port).lower()


def _host_port(host: str, default_port: int | None) -> str:
    url = URL(f"http://{host}")
    return f"{url.host}:{url.port if url.explicit_port else default_port}"


def is_preflight(request: web.Request) -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


def preflight(request: web.Request) -> web.Response:
    """The answer to an allowed origin's preflight (check has refused the others)."""
    response = web.Response(status=204)
    response.headers["Access-Control-Allow-Methods"] = _ALLOW_METHODS
    response.headers["Access-Control-Allow-Headers"] = _ALLOW_HEADERS
    response.headers["Access-Control-Max-Age"] = _PREFLIGHT_MAX_AGE
    return response


def cors_headers(request: web.Request, response: web.StreamResponse, expose: str) -> None:
    """An allowed cross-site origin may read the reply, and the `expose` headers of it."""
    origin = request.get(CORS_ORIGIN)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = expose
        response.headers["Vary"] = "Origin"
