"""Images a request carries: where each comes from, and each one decoded and known by its pixels.

An image reaches kvfork as a URL in a content part (every API's shape is translated into chat's
`image_url`): a `data:` URL holding it in base64, or an http(s) URL. kvfork fetches nothing on its own:
an http(s) URL is refused unless its host is one the operator allowed (`--allowed-media-domains`), and a
text-only model fetches none even then (server/api/images.py).

Decoding is Pillow's, for PNG, JPEG, WebP and GIF only (the first frame of an animation), on worker
threads that tenants share in turn (server/guard/fair_workers.py, as the tokenizer's long work): a tenant decodes one
image at a time, so another tenant's request never waits behind its queue. The work is bounded before it
starts: the body by `--max-body-bytes`, the count by `--max-images`, and the pixels by
`--max-image-pixels`, checked on the header before any pixel is decoded (a decompression bomb is refused
by what it claims, not by what it would cost). An image a tenant sent lately is not decoded again: an
agent's history carries each screenshot from turn to turn.

An image's identity is `Image.digest`, a SHA-256 kvfork computes over the decoded pixels (their size and
every RGBA value), never anything the client says about it (a URL, a declared type, a hash): the same
picture sent as PNG or as a lossless WebP is the same image, and any changed pixel is another one.
Whatever keys a cache by it scopes it by tenant as every cache is.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass

from yarl import URL

from kvfork.server.guard.errors import client_text
from kvfork.server.guard.fair_workers import FairWorkers
from kvfork.server.watch.metrics import Registry

# Pillow's format names -> the media types kvfork reads
MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
READABLE = "PNG, JPEG, WebP or GIF"
DECODE_THREADS = 2  # a tenant decodes one image at a time: with two, another tenant always finds one free
_BASE64_SPACE = str.maketrans("", "", " \t\r\n")  # MIME-wrapped base64 (lines of 76) reads too
REMEMBERED = 1024  # images remembered once decoded (what they are and their hash), all tenants together


@dataclass(frozen=True)
class Image:
    media_type: str  # what the bytes are, by their own header
    width: int
    height: int
    digest: str  # SHA-256 of the decoded pixels, hex: the image's identity

    def __str__(self) -> str:
        return f"{self.media_type}, {self.width}x{self.height} pixels"


class ImageRefused(ValueError):
    """An image kvfork will not read: the message says why, naming the flag where one raises the limit."""


@dataclass(frozen=True)
class DataUrl:
    payload: str  # the base64 text (its declared type is checked, the decoded one is what counts)


@dataclass(frozen=True)
class RemoteUrl:
    host: str  # an allowed one (--allowed-media-domains)


def source_of(url: str, allowed_domains: list[str]) -> DataUrl | RemoteUrl:
    """Where an image URL points: a base64 data URL of an image type kvfork reads, or an http(s) URL on an
    allowed domain; anything else is refused, before any work."""
    if url[:5].lower() == "data:":
        head, comma, payload = url[5:].partition(",")
        media_type, *parameters = head.split(";")
        if not comma or not parameters or parameters[-1].lower() != "base64":
            raise ImageRefused("a data URL holds the image in base64: data:image/png;base64,...")
        if media_type.lower() not in MEDIA_TYPES.values():
            raise ImageRefused(f"the data URL's type is {client_text(media_type, 40)}; kvfork reads {READABLE} images "
                               f"({', '.join(MEDIA_TYPES.values())})")
        return DataUrl(payload)
    try:
        parsed = URL(url)  # aiohttp's own reading of a URL, the one a fetch would make
    except ValueError:
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ImageRefused("an image is a data URL (data:image/png;base64,...) or an http(s) URL")
    if parsed.host not in {d.lower() for d in allowed_domains}:
        raise ImageRefused("kvfork fetches no image from the network unless the operator allows its domain "
                           "(--allowed-media-domains); send the image as a data URL (data:image/png;base64,...)")
    return RemoteUrl(parsed.host)


def decode(payload: str, max_pixels: int) -> Image:
    """A base64 image decoded (its first frame) and hashed; ImageRefused when it is not one kvfork reads."""
    media_type, pixels = _pixels(payload, max_pixels)
    width, height = pixels.size
    digest = hashlib.sha256(f"{width}x{height}:".encode())
    digest.update(pixels.tobytes())
    return Image(media_type, width, height, digest.hexdigest())


def picture(payload: str, max_pixels: int):
    """The image's pixels as a vision model's processor takes them: a Pillow image, RGB (decoded again where
    a model must encode it: what `Images` remembers is the image's identity, not its pixels)."""
    return _pixels(payload, max_pixels)[1].convert("RGB")


def _pixels(payload: str, max_pixels: int):
    """(media type, first frame as RGBA) of a base64 image; ImageRefused when it is not one kvfork reads."""
    from PIL import Image as Pillow, UnidentifiedImageError

    try:
        data = base64.b64decode(payload.translate(_BASE64_SPACE), validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("the image's data is not base64") from None
    try:
        picture = Pillow.open(io.BytesIO(data), formats=list(MEDIA_TYPES))
    except Pillow.DecompressionBombError:
        raise ImageRefused(f"the image holds more than {max_pixels:,} pixels, the limit "
                           "(--max-image-pixels)") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageRefused(f"the image is not a {READABLE} image kvfork can decode") from None
    with picture:
        width, height = picture.size
        if width * height > max_pixels:
            raise ImageRefused(f"the image is {width}x{height}, {width * height:,} pixels; the limit is "
                               f"{max_pixels:,} (--max-image-pixels)")
        try:
            picture.seek(0)
            pixels = picture.convert("RGBA")
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise ImageRefused(f"the {MEDIA_TYPES[picture.format]} image cannot be decoded: "
                               f"{str(e)[:120]}") from None
        return MEDIA_TYPES[picture.format], pixels


class Images:
    """The decoding threads; the images each tenant sent lately, by their bytes, so a screenshot an agent's
    history carries from turn to turn is decoded once; and the count of images a text-only model was given
    as a line of text."""

    def __init__(self, registry: Registry, remembered: int = REMEMBERED):
        self._workers: FairWorkers | None = None  # started by the first image
        self._known: OrderedDict[tuple[str, bytes], Image] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._remembered = remembered
        self.replaced = registry.counter("images_replaced_total", "images in tool results given to a text-only "
                                         "model as a line of text naming them (--images), by media type")

    async def read(self, tenant: str, source: DataUrl, max_pixels: int) -> Image:
        if self._workers is None:
            self._workers = FairWorkers(DECODE_THREADS, "kvfork-images")
        return await self._workers.run(tenant, self._read, tenant, source.payload, max_pixels)

    def _read(self, tenant: str, payload: str, max_pixels: int) -> Image:
        """On a worker: the image these bytes hold, decoded once per tenant (the key is kvfork's own hash of the
        bytes, which decode to the same pixels every time; another tenant's decoding is never shared, so no
        tenant learns by its timing what another sent)."""
        key = (tenant, hashlib.sha256(payload.encode("ascii", "replace")).digest())
        with self._lock:
            image = self._known.get(key)
            if image is not None:
                self._known.move_to_end(key)
                return image
        image = decode(payload, max_pixels)
        with self._lock:
            self._known[key] = image
            while len(self._known) > self._remembered:
                self._known.popitem(last=False)
        return image

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
