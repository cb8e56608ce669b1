"""A prompt with images, for a model that reads them (backends/vision).

Each image part of a message is written into the template's input as its mark, a line naming the
image by its pixel hash (so the text a template renders, and the diagnostics' fingerprint of the
messages, change with the image). Once rendered, the text is cut at the marks: the pieces between are
encoded as any rendered text, and each mark becomes the text the model's family lays an image of its
size out as (`ImageProcessing.prompt_text`), encoded, its placeholder tokens turned into the image's keys
(backends/vision/keys.py). Every reuse path then compares the image by its identity.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from kvfork.backends.vision import ImageInput
from kvfork.backends.vision.keys import image_id, image_keys
from kvfork.server.generate.images import Image
from kvfork.server.guard.errors import ApiError
from kvfork.server.text.tokenizer import PromptTokenizer


@dataclass(frozen=True)
class SeenImage:
    """An image a vision model reads: what it is, and its pixels when the model must encode it."""

    image: Image
    load: Callable[[], Any]  # the decoded picture, RGB (server/generate/images.py's `picture`)

_MARK = re.compile(r"<\|kvfork-image ([0-9a-f]{64})\|>")


def image_mark(seen: SeenImage) -> str:
    return f"<|kvfork-image {seen.image.digest}|>"


async def vision_prompt(tokenizer: PromptTokenizer, text: str, images: list[SeenImage],
                        tenant: str) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The rendered `text`'s tokens, each image's placeholders as its keys, and the images in prompt order."""
    processing = tokenizer.vision
    pieces = _MARK.split(text)  # text, digest, text, digest, ..., text
    digests = pieces[1::2]
    if processing is None or digests != [seen.image.digest for seen in images]:
        raise ApiError(400, f"the prompt holds {len(digests)} image marks where the messages hold {len(images)} "
                       "images (a chat template that drops or repeats a message's content, or text that imitates "
                       "a mark)", code="invalid_value", param="messages")
    prompt: list[int] = []
    placed = []
    for n, seen in enumerate(images):
        prompt += await tokenizer.encode_rendered(pieces[2 * n], tenant)
        layout = await tokenizer.encode_rendered(processing.prompt_text(seen.image.width, seen.image.height), tenant)
        count = layout.count(processing.image_token_id)
        keys = iter(image_keys(image_id(seen.image.digest), count))
        start = len(prompt) + layout.index(processing.image_token_id)
        end = len(prompt) + len(layout) - layout[::-1].index(processing.image_token_id)
        prompt += [next(keys) if t == processing.image_token_id else t for t in layout]
        placed.append(ImageInput(image_id(seen.image.digest), start, end, count, seen.load, processing.bidirectional))
    prompt += await tokenizer.encode_rendered(pieces[-1], tenant)
    return prompt, tuple(placed)
