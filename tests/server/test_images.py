"""Images read and known by their pixels (server/generate/images.py): the four formats (a GIF's first frame), the same
pixels the same identity whatever the encoding, any changed pixel another one; URLs kvfork takes; a
decompression bomb refused by its header before a pixel is decoded."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image as Pillow

from kvfork.server.generate import images
from kvfork.server.generate.images import DataUrl, ImageRefused, Images, RemoteUrl, decode, source_of
from kvfork.server.watch.metrics import Registry

BIG = 1 << 24


def encoded(picture: Pillow.Image, form: str, **options) -> str:
    out = io.BytesIO()
    picture.save(out, form, **options)
    return base64.b64encode(out.getvalue()).decode()


def gradient(width: int = 32, height: int = 24) -> Pillow.Image:
    return Pillow.frombytes("RGB", (width, height), bytes((x * 7 + y) % 256 for y in range(height)
                                                          for x in range(width) for _ in range(3)))


def test_the_same_pixels_are_the_same_image_whatever_the_format():
    picture = gradient()
    png, webp = decode(encoded(picture, "PNG"), BIG), decode(encoded(picture, "WEBP", lossless=True), BIG)
    assert (png.media_type, webp.media_type) == ("image/png", "image/webp")
    assert (png.width, png.height) == (32, 24) and png.digest == webp.digest
    changed = picture.copy()
    changed.putpixel((31, 23), (0, 0, 1))
    assert decode(encoded(changed, "PNG"), BIG).digest != png.digest
    jpeg = decode(encoded(picture, "JPEG"), BIG)
    assert jpeg.media_type == "image/jpeg" and jpeg.digest != png.digest  # lossy: other pixels


def test_a_gif_is_read_by_its_first_frame():
    first, second = gradient().convert("P"), Pillow.new("P", (32, 24), 3)
    out = io.BytesIO()
    first.save(out, "GIF", save_all=True, append_images=[second])
    animated = decode(base64.b64encode(out.getvalue()).decode(), BIG)
    assert animated.media_type == "image/gif"
    assert animated.digest == decode(encoded(first, "GIF"), BIG).digest


def png_header(width: int, height: int) -> str:
    """A PNG that claims a size and holds no pixels: what a decompression bomb shows before it is decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    head = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + head + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
                            ).decode()


@pytest.mark.parametrize("payload, said", [
    (png_header(9000, 9000), "81,000,000 pixels; the limit is 64,000,000 (--max-image-pixels)"),
    (png_header(100_000, 100_000), "more than 64,000,000 pixels, the limit (--max-image-pixels)"),
    (encoded(gradient(), "BMP"), "not a PNG, JPEG, WebP or GIF image"),
    (encoded(gradient(), "TIFF"), "not a PNG, JPEG, WebP or GIF image"),
    (encoded(gradient(200, 200), "PNG")[:400], "cannot be decoded"),
    ("not base64!", "not base64"),
])
def test_what_kvfork_does_not_read_is_refused_saying_why(payload, said):
    with pytest.raises(ImageRefused) as refused:
        decode(payload, 64_000_000)
    assert said in str(refused.value)


def test_urls_data_or_an_allowed_host_only():
    assert source_of("data:image/PNG;base64,AAAA", []) == source_of("data:image/png;name=a.png;base64,AAAA", []) == \
        DataUrl("AAAA")
    assert source_of("https://user@Shots.example.com:8443/a.png?x#y", ["shots.example.com"]) == \
        RemoteUrl("shots.example.com")
    for url, said in [("data:image/png,raw", "base64"), ("data:image/svg+xml;base64,AAAA", "image/svg+xml"),
                      ("https://shots.example.com.evil.test/a.png", "--allowed-media-domains"),
                      ("http://evil.test/?shots.example.com", "--allowed-media-domains"),
                      ("https://shots.example.com\\@evil.test/", "data URL"),
                      ("file:///etc/passwd", "data URL"), ("ftp://shots.example.com/a.png", "data URL")]:
        with pytest.raises(ImageRefused, match=said.replace("+", r"\+")):
            source_of(url, ["shots.example.com"])


async def test_a_tenants_image_is_decoded_once_and_never_for_another_tenant(monkeypatch):
    decoded = []
    monkeypatch.setattr(images, "decode", lambda payload, limit: decoded.append(payload) or decode(payload, limit))
    reader = Images(Registry(), remembered=2)
    try:
        shot, other = (DataUrl(encoded(picture, "PNG")) for picture in (gradient(), gradient(8, 8)))
        first = await reader.read("a", shot, BIG)
        assert await reader.read("a", shot, BIG) == first and len(decoded) == 1  # the next turn's history
        assert await reader.read("b", shot, BIG) == first and len(decoded) == 2  # another tenant decodes its own
        await reader.read("a", other, BIG)  # past `remembered`: the least recently used goes
        await reader.read("a", shot, BIG)
        assert len(decoded) == 4
    finally:
        reader.close()
