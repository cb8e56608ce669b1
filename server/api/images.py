"""The images of a chat request: read by a vision model, or as a text-only model takes them.

Every API's images arrive here as chat `image_url` parts: chat's own, Responses' `input_image`, and
Messages' `image` blocks (in user turns and inside `tool_result` content), translated into them. Each is
checked before any work (their count, then each URL: server/generate/images.py), then:
- an image in a user's message (or any turn but a tool result) is a 400 naming the model, as OpenAI
  answers a model that reads no images;
- an image inside a tool result (an agent reading a screenshot) is decoded and replaced by one line of
  text naming its media type and size, so the agent's session goes on; counted in /metrics
  (`kvfork_images_replaced_total`) and logged, one line a request (with each image's hash, by which
  the same screenshot is told across turns). `--images refuse` makes it a 400 too. An http(s) URL on an
  allowed domain is never fetched for it: the line names its host.
The line is all the model sees of the image, so count_tokens counts it.

A model that reads images (backends/vision) takes every image part of any turn: each is decoded and known
by its pixel hash (server/generate/images.py), and its pixels are decoded again only where the model must encode
it. kvfork fetches no URL for it: an http(s) image is a 400 that says to send a data URL.
"""

from __future__ import annotations

import logging
import functools
from dataclasses import dataclass

from kvfork.server.api.chat.protocol import ChatMessage
from kvfork.server.api.vision import SeenImage
from kvfork.server.common.state import Services
from kvfork.server.generate.images import DataUrl, ImageRefused, RemoteUrl, picture, source_of
from kvfork.server.guard.errors import ApiError, client_text, invalid
from kvfork.server.guard.limits import over

log = logging.getLogger("kvfork.http")
IMAGE_PART = "image_url"
_LOGGED_IMAGES = 8  # images one request's log line names


@dataclass(frozen=True)
class ImagePart:
    message: int
    part: int
    url: str
    role: str  # of the message holding it: `tool`, a tool's result

    @property
    def in_tool_result(self) -> bool:
        return self.role == "tool"

    @property
    def param(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"


def image_parts(messages: list[ChatMessage]) -> list[ImagePart]:
    """The image parts of the messages, in order; a 400 for one without its URL."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != IMAGE_PART:
                continue
            url = part.image_url if isinstance(part.image_url, str) or part.image_url is None else part.image_url.url
            if not url:
                raise invalid(f"messages[{i}].content[{j}].image_url", 'an image_url part is {"type": "image_url", '
                              '"image_url": {"url": "data:image/png;base64,..."}}')
            out.append(ImagePart(i, j, url, message.role))
    return out


async def read_images(services: Services, messages: list[ChatMessage], model: str, tenant: str, rid: str,
                      vision: bool) -> dict[tuple[int, int], str | SeenImage]:
    """Each image by (message, part): for a `vision` model the image, else the line of text standing for it;
    a 400 for any the model cannot take."""
    parts = image_parts(messages)
    if not parts:
        return {}
    config = services.config
    if len(parts) > config.max_images:
        raise over("messages", f"the request holds {len(parts):,} images", config.max_images, "--max-images",
                   "array_above_max_length")
    sources = []
    for n, part in enumerate(parts, 1):
        try:
            sources.append(source_of(part.url, config.allowed_media_domains))
        except ImageRefused as e:
            raise invalid(part.param, f"image {n}: {e}") from None
    if vision:
        return {(part.message, part.part): await _seen(services, source, tenant, n, part)
                for n, (part, source) in enumerate(zip(parts, sources), 1)}
    for n, part in enumerate(parts, 1):
        if not part.in_tool_result or config.images == "refuse":
            where = "inside a tool result" if part.in_tool_result else f"in a {part.role} message"
            raise ApiError(400, f"the model {model!r} reads text only: image {n} ({where}) cannot be sent to it; "
                           "send text", code="unsupported_content", param=part.param)
    described = [await _describe(services, source, tenant, n, part)
                 for n, (part, source) in enumerate(zip(parts, sources), 1)]
    for _, media_type, _ in described:  # counted once every image is read: a request refused counts none
        services.images.replaced.inc(media_type=media_type)
    logged = [f"image {n} {known}" for n, (_, _, known) in enumerate(described[:_LOGGED_IMAGES], 1)]
    more = f" and {len(described) - _LOGGED_IMAGES} more" if len(described) > _LOGGED_IMAGES else ""
    log.info("%s: images in tool results given to the text-only model %s as a line of text each (--images): %s%s",
             rid, client_text(model), ", ".join(logged), more)
    return {(part.message, part.part): f"[{what}: not shown, this model reads text only]"
            for part, (what, _, _) in zip(parts, described)}


async def _seen(services: Services, source: DataUrl | RemoteUrl, tenant: str, n: int, part: ImagePart) -> SeenImage:
    if isinstance(source, RemoteUrl):
        raise invalid(part.param, f"image {n}: kvfork fetches no image for a model to read; send it as a data URL "
                      "(data:image/png;base64,...)")
    max_pixels = services.config.max_image_pixels
    try:
        image = await services.images.read(tenant, source, max_pixels)
    except ImageRefused as e:
        raise invalid(part.param, f"image {n}: {e}") from None
    return SeenImage(image, functools.partial(picture, source.payload, max_pixels))


async def _describe(services: Services, source: DataUrl | RemoteUrl, tenant: str, n: int,
                    part: ImagePart) -> tuple[str, str, str]:
    """What the line says of an image, its media type (for /metrics) and what the log says of it."""
    if isinstance(source, RemoteUrl):
        return f"an image at {source.host}, not fetched", "url", f"at {source.host}"
    try:
        image = await services.images.read(tenant, source, services.config.max_image_pixels)
    except ImageRefused as e:
        raise invalid(part.param, f"image {n}: {e}") from None
    return f"{image.media_type} image, {image.width}x{image.height} pixels", image.media_type, \
        f"{image}, sha256 {image.digest[:12]}"
