"""Qwen2.5-VL and Gemma 3 on the torch backend against transformers' own models: an image in the prompt,
prefilled in chunks, then a decode step, a clone past the image and a state through the host (float32, CPU).

The folders are tools/vision_model.py's tiny random models; the prompts hold image keys, as the server
writes them (backends/vision/keys.py), each image encoded by Backend.encode_images; the reference is
Qwen2_5_VLForConditionalGeneration / Gemma3ForConditionalGeneration over the whole sequence at once, so
kvfork's M-RoPE positions (the text after an image continuing from the image's largest position, not its
slot) and Gemma's image attended both ways are checked against transformers' own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfork.backends.torch.backend import TorchBackend
from kvfork.backends.vision import ImageInput, load_processing
from kvfork.backends.vision.keys import image_keys, is_image_key
from kvfork.tools import vision_family_models, vision_model
from tolerance import Kind, Model, assert_logits_close

pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

# (width, height) of each image: Qwen's processor keeps the aspect (4 x 6 and 6 x 4 patches of 14 pixels
# merged 2 x 2: 6 tokens each, on unequal grids), Gemma's squares it (16 tokens, more than its window of 8)
SIZES = {"qwen2_5_vl": ((84, 56), (56, 84)), "gemma3": ((120, 90), (64, 64))}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = vision_model.write(tmp_path_factory.mktemp(family), family=family)
        return made[family]

    return get


def _picture(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


class Case:
    """A prompt of text, an image, text, another image, text, its images as keys; a backend that read them."""

    def __init__(self, family: str, folder):
        from tokenizers import Tokenizer

        self.family, self.folder = family, folder
        self.processing = load_processing(folder, None)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        rng = np.random.default_rng(7)
        self.pictures = [_picture(i, size) for i, size in enumerate(SIZES[family])]
        self.tokens, self.inputs = rng.integers(3, 500, 5).tolist(), []
        for n, picture in enumerate(self.pictures):  # each image as the server writes it: its text, its keys
            text = tokenizer.encode(self.processing.prompt_text(*picture.size), add_special_tokens=False).ids
            count = text.count(self.processing.image_token_id)
            keys = iter(image_keys(1000 + n, count))
            first = len(self.tokens) + text.index(self.processing.image_token_id)
            self.inputs.append(ImageInput(1000 + n, first, first + count, count, lambda p=picture: p))
            self.tokens += [next(keys) if t == self.processing.image_token_id else t for t in text]
            self.tokens += rng.integers(3, 500, 4).tolist()
        self.forced = int(rng.integers(3, 500))  # the decode step's token
        self.backend = TorchBackend("cpu")
        self.backend.load(str(folder), "float32")
        assert self.backend.encode_images(self.inputs, "tenant") == len(self.inputs)

    def reference(self, pictures: list[Image.Image] | None = None) -> np.ndarray:
        """transformers' logits at every position of the prompt and the forced token (with `pictures` in place
        of the prompt's own, where given)."""
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(self.folder, dtype=torch.float32).eval()
        ids = torch.tensor([[self.processing.image_token_id if is_image_key(t) else t
                             for t in self.tokens + [self.forced]]])
        batch = self.processing.images(images=pictures or self.pictures, return_tensors="pt")
        is_image = (ids == self.processing.image_token_id).int()
        with torch.inference_mode():
            if self.family == "qwen2_5_vl":
                out = model(input_ids=ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                            mm_token_type_ids=is_image)
            else:
                out = model(input_ids=ids, pixel_values=batch["pixel_values"], token_type_ids=is_image)
        return out.logits[0].float().numpy()

    def cuts(self) -> list[int]:
        """Chunk ends: Qwen's inside an image (positions continue across), Gemma's around its images."""
        first, second = self.inputs
        if self.family == "qwen2_5_vl":
            return [first.start + 2, second.start + 3, len(self.tokens)]
        return [first.start - 1, first.end + 2, len(self.tokens)]

    def close(self, got, want, context: int) -> None:
        assert_logits_close(got, want, kind=Kind.FORMS, model=Model.of(self.folder), context=context)


@pytest.fixture(scope="module", params=vision_family_models.FAMILIES)
def case(request, family_dir):
    made = Case(request.param, family_dir(request.param))
    return made, made.reference()


def _prefill(backend, session, case: Case, start: int, end: int):
    return backend.to_numpy(backend.prefill([session], [case.tokens[start:end]]))[0]


@pytest.mark.numeric
def test_chunked_prefill_and_decode_match_transformers(case):
    case, want = case
    backend = case.backend
    session, start = backend.open_session(), 0
    for end in case.cuts():
        case.close(_prefill(backend, session, case, start, end), want[end - 1], end)
        start = end
    n = len(case.tokens)
    case.close(backend.to_numpy(backend.decode([session], [case.forced]))[0], want[n], n + 1)


@pytest.mark.numeric
def test_the_images_pixels_reach_the_text_model(case):
    """Other pictures of the same sizes change the logits after them past what rounding explains (a tower or
    projector that output zeros would make the comparisons above blind to the images)."""
    case, want = case
    other = case.reference([_picture(100 + i, p.size) for i, p in enumerate(case.pictures)])
    after = case.inputs[0].end
    with pytest.raises(AssertionError, match=Kind.FORMS.value):
        case.close(other[after:], want[after:], len(case.tokens))


@pytest.mark.numeric
def test_clone_and_saved_state_continue_from_the_images_positions(case):
    """A clone taken past the first image, and a state through the host after both, go on as transformers
    does: their next positions are the images' shifts, not their token counts."""
    case, want = case
    backend = case.backend
    session, n, upto = backend.open_session(), len(case.tokens), case.inputs[0].end + 1
    _prefill(backend, session, case, 0, upto)
    clone = backend.clone(session, upto)
    case.close(_prefill(backend, clone, case, upto, n), want[n - 1], n)
    restored = backend.import_state(backend.export_state(clone))
    for s in (clone, restored):
        case.close(backend.to_numpy(backend.decode([s], [case.forced]))[0], want[n], n + 1)


def test_a_chunk_may_not_cut_an_image_attended_both_ways(family_dir):
    case = Case("gemma3", family_dir("gemma3"))
    session = case.backend.open_session()
    with pytest.raises(ValueError, match="cuts the image"):
        _prefill(case.backend, session, case, 0, case.inputs[0].start + 3)
    assert session.position == 0
