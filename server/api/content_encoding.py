"""Compressed request bodies (`Content-Encoding`), decoded here rather than in aiohttp's parser.

Clients compress what they send: Codex CLI sends zstd (`enable_request_compression`) to its built-in
OpenAI provider, others gzip. The server's aiohttp is built with `auto_decompress=False` (app.py)
because its parser answers a coding it cannot decode, or a body that does not decode, in plain text
before any middleware runs, or lets it surface as a 500. Decoded here, every outcome is a reply in the
API's own error shape:

- no coding, or `identity`: the body as sent;
- `gzip` (`x-gzip`), `deflate` (zlib's format, or the raw deflate some clients send under that name) and
  `zstd`: decoded into at most --max-body-bytes, one member or frame after another; a body that would
  inflate past that is a 413 as soon as the limit is passed (a small frame of a huge body is never
  inflated further);
- a body that does not decode (corrupt, cut short, or followed by bytes that are no member) is a 400;
- any other coding, or several stacked, is a 415 that names the codings accepted.

zstd comes from the standard library's `compression.zstd` from Python 3.14, and from `backports.zstd`
(the same module, a dependency below 3.14) before it.
"""

from __future__ import annotations

import sys
import zlib
from types import ModuleType
from typing import Any

from kvfork.server.guard.errors import ApiError, client_text

CODINGS = ("gzip", "deflate", "zstd")
_ALIASES = {"x-gzip": "gzip"}


def coding_of(header: str | None) -> str | None:
    """The one coding a `Content-Encoding` header names (None: the body is sent as is); a 415 for one
    that is not decoded here, or for several stacked."""
    names = [name.strip().lower() for name in (header or "").split(",")]
    names = [_ALIASES.get(name, name) for name in names if name and name != "identity"]
    if not names:
        return None
    if len(names) > 1 or names[0] not in CODINGS:
        raise ApiError(415, f"Content-Encoding {client_text(header.strip())} is not supported: send the body as "
                       f"is, or in one of {', '.join(CODINGS)}", code="unsupported_content_encoding")
    return names[0]


def decoded(raw: bytes, coding: str, limit: int) -> bytes:
    """`raw` decoded from `coding` (one of CODINGS), into at most `limit` bytes."""
    out, rest = bytearray(), raw
    while rest:
        decompressor = _decompressor(coding, rest)
        try:
            out += decompressor.decompress(rest, limit + 1 - len(out))
        except Exception as e:  # zlib.error, ZstdError: what each library raises on a corrupt stream
            raise _undecodable(coding, str(e)) from None
        if len(out) > limit:
            raise ApiError(413, f"the request body inflates past --max-body-bytes ({limit:,} bytes)",
                           code="body_too_large")
        if not decompressor.eof:
            raise _undecodable(coding, "it ends before its stream does")
        rest = decompressor.unused_data  # the next gzip member or zstd frame
    return bytes(out)


def _decompressor(coding: str, data: bytes) -> Any:
    if coding == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if coding == "deflate":  # zlib's header: CM 8 and a check that makes the first two bytes a multiple of 31
        wrapped = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
        return zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
    return zstd().ZstdDecompressor()


def zstd() -> ModuleType:
    """The zstd module: the standard library's from Python 3.14, `backports.zstd` (a dependency) before."""
    if sys.version_info >= (3, 14):
        from compression import zstd as module
    else:
        from backports import zstd as module
    return module


def _undecodable(coding: str, why: str) -> ApiError:
    return ApiError(400, f"the request body does not decode as its Content-Encoding {coding}: {why}",
                    code="invalid_content_encoding")
