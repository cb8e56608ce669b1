"""Compressed request bodies (server/api/content_encoding.py): a body sent in gzip, deflate or zstd is
answered as the same body sent plain; one that does not decode is a 400, a coding not decoded here a 415,
and a small body that inflates past --max-body-bytes a 413, each in the error shape of the API it was
sent to (OpenAI's on chat completions, Anthropic's on messages)."""

from __future__ import annotations

import gzip
import json
import zlib

import aiohttp
import pytest
import pytest_asyncio

from agent_server import agent_model, reply  # noqa: F401 (fixture)
from http_daemon import serving
from scripted_replies import scripted
from kvfork.server.api.content_encoding import zstd

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMIT = 1 << 20  # --max-body-bytes
CHAT = ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}],
                                 "max_tokens": 64, "temperature": 0})
MESSAGES = ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}],
                             "max_tokens": 64, "temperature": 0})
ROUTES = pytest.mark.parametrize("route", [CHAT, MESSAGES], ids=["chat", "messages"])


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # no zlib header, as some clients send `deflate`
    return packer.compress(data) + packer.flush()


# how each coding packs a body; two gzip members and two zstd frames are one body each
PACK = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,
    "deflate (raw)": raw_deflate,
    "zstd": lambda data: zstd().compress(data),
    "gzip (two members)": lambda data: gzip.compress(data[:10]) + gzip.compress(data[10:]),
    "zstd (two frames)": lambda data: zstd().compress(data[:10]) + zstd().compress(data[10:]),
    "identity": lambda data: data,
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(agent_model):
    async with serving(agent_model, scripted(agent_model, reply), served_model_name=["tiny"],
                       max_body_bytes=LIMIT) as d:
        yield d


async def post(daemon, path: str, data: bytes, coding: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Content-Encoding": coding} if coding else {})}
    async with aiohttp.ClientSession() as http, http.post(daemon.url + path, data=data, headers=headers) as r:
        assert r.content_type == "application/json", await r.text()
        return r.status, await r.json()


def answer(path: str, body: dict) -> object:
    """What a reply says, without its ids and times."""
    if path == CHAT[0]:
        return body["choices"][0]["message"], body["usage"]
    return body["content"], body["usage"]


def error_in_shape(path: str, body: dict) -> str:
    """The error's message, once its shape is the API's own."""
    if path == MESSAGES[0]:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"]


@ROUTES
@pytest.mark.parametrize("name", PACK)
async def test_a_compressed_body_is_answered_as_the_plain_one(daemon, route, name):
    path, body = route
    data = json.dumps(body).encode()
    plain_status, plain = await post(daemon, path, data, None)
    status, packed = await post(daemon, path, PACK[name](data), name.split(" ")[0])
    assert status == plain_status == 200 and answer(path, packed) == answer(path, plain)


@ROUTES
@pytest.mark.parametrize("coding,data", [
    ("gzip", gzip.compress(b'{"messages": []}')[:-6] + b"garbage"),  # its checksum broken
    ("gzip", gzip.compress(b'{"messages": []}')[:12]),  # cut short
    ("deflate", b"\xff" * 40),
    ("zstd", b"\x28\xb5\x2f\xfd" + b"not a frame" * 4),  # zstd's magic number, then garbage
    ("zstd", zstd().compress(b'{"messages": []}')[:-4]),  # cut short
    ("gzip", gzip.compress(b'{"messages": []}') + b"trailing bytes"),
], ids=["gzip-checksum", "gzip-cut", "deflate-garbage", "zstd-garbage", "zstd-cut", "gzip-trailing"])
async def test_a_body_that_does_not_decode_is_a_400(daemon, route, coding, data):
    status, body = await post(daemon, route[0], data, coding)
    assert status == 400 and f"does not decode as its Content-Encoding {coding}" in error_in_shape(route[0], body)


@ROUTES
@pytest.mark.parametrize("coding", ["br", "compress", "x-unknown", "gzip, zstd"])
async def test_a_coding_not_decoded_here_is_a_415(daemon, route, coding):
    status, body = await post(daemon, route[0], json.dumps(route[1]).encode(), coding)
    message = error_in_shape(route[0], body)
    assert status == 415 and "gzip, deflate, zstd" in message
    if route[0] == CHAT[0]:
        assert body["error"]["code"] == "unsupported_content_encoding"


@ROUTES
async def test_a_small_zstd_body_that_inflates_past_the_limit_is_a_413(daemon, route):
    # 64 frames of 64 MiB of spaces each: 4 GiB inflated from a few hundred kilobytes, of which the daemon
    # inflates the first frame's first MiB and a byte, and stops there
    frame = zstd().compress(b" " * (64 << 20))
    status, body = await post(daemon, route[0], frame * 64, "zstd")
    assert len(frame) * 64 < LIMIT
    assert status == 413 and "inflates past --max-body-bytes" in error_in_shape(route[0], body)
