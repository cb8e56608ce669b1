"""Image keys: how an image's tokens are written in a token sequence.

Every reuse path (the prefix cache, a running request's clone, following, named sessions, the disk
tier, cache diagnostics) compares plain lists of ints. An image's embedding positions are written as
keys above every vocabulary, each naming the image (40 bits of the SHA-256 kvfork computed over its
decoded pixels, server/generate/images.py) and the token's index inside it. So the same image at the same place
is the same tokens, a changed image differs from its first token on, and whatever separates tenants for
text (the scope) separates them for images. A backend that reads images turns a key back into its
image's embedding row (Backend.encode_images); the rest of the engine never looks inside one.
"""

from __future__ import annotations

from typing import Iterable, Sequence

IMAGE_KEY_BASE = 1 << 62  # above every vocabulary; a key still fits an int64
INDEX_BITS = 20  # a token's index inside its image: at most 2**20 tokens an image
ID_BITS = 40  # of the pixel hash: a collision between two of one tenant's images is a 2**-40 chance
MAX_IMAGE_TOKENS = 1 << INDEX_BITS


def image_id(digest: str) -> int:
    """The image's id in its keys: the first 40 bits of its pixel hash (hex)."""
    return int(digest[:ID_BITS // 4], 16)


def image_keys(image: int, n: int) -> list[int]:
    """The keys of an image's `n` tokens."""
    if not 0 < n <= MAX_IMAGE_TOKENS:
        raise ValueError(f"an image takes 1 to {MAX_IMAGE_TOKENS} tokens, not {n}")
    base = IMAGE_KEY_BASE | image << INDEX_BITS
    return list(range(base, base + n))


def is_image_key(token: int) -> bool:
    return token >= IMAGE_KEY_BASE


def image_of(key: int) -> int:
    return (key - IMAGE_KEY_BASE) >> INDEX_BITS


def index_of(key: int) -> int:
    return key & (MAX_IMAGE_TOKENS - 1)


def image_tokens(tokens: Iterable[int]) -> int:
    """How many of the tokens are image keys."""
    return sum(1 for t in tokens if t >= IMAGE_KEY_BASE)


def text_only(tokens: Iterable[int]) -> list[int]:
    """The tokens without image keys (what a sampler's penalties and the drafters read)."""
    return [t for t in tokens if t < IMAGE_KEY_BASE]


def image_start(tokens: Sequence[int], upto: int) -> int:
    """`upto` (a count of leading tokens) moved back to the first key of the image whose keys it splits (the
    token after it is one of the image's keys but its first), so a reuse point never falls inside an image
    (a family whose image tokens attend both ways, or are placed in 3-D, computes none of them alone); `upto`
    itself elsewhere. The walk back is bounded by the image's span:
    its first key lies at least its index back (further where text lies between its keys: Idefics3's tiles)."""
    if not 0 < upto < len(tokens) or not is_image_key(tokens[upto]) or index_of(tokens[upto]) == 0:
        return upto
    first = tokens[upto] - index_of(tokens[upto])
    at = upto - index_of(tokens[upto])
    while at > 0 and tokens[at] != first:
        at -= 1
    return at
