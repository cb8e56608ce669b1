"""A vision model on torch: kvfork's prompt and logits equal transformers' Idefics3 (SmolVLM) and SmolVLM
(SmolVLM2) own, an image in the prompt, prefilled in chunks that cut the image, then decoded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvfork.backends.torch.backend import TorchBackend
from kvfork.backends.vision import ImageInput, load_processing
from kvfork.backends.vision.idefics3 import image_seq_len
from kvfork.backends.vision.keys import IMAGE_KEY_BASE, image_keys, image_start, is_image_key
from kvfork.server.engine.policy.matching import Source, usable_upto
from kvfork.server.text.tokenizer import PromptTokenizer
from kvfork.tools.vision_model import write
from tolerance import Kind, Model, assert_logits_close

IMAGE_ID = 0x1234567890
TEXT = ("<|im_start|>User: what is on the screen?", "<end_of_utterance>\nAssistant:")


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    return str(write(tmp_path_factory.mktemp("smolvlm")))


def _picture(width: int, height: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompt(folder: str, picture) -> tuple[list[int], ImageInput, PromptTokenizer]:
    tokenizer = PromptTokenizer.load(folder)
    tokenizer.vision = processing = load_processing(folder, tokenizer.tokenizer)
    before, after = (tokenizer.encode_rendered_text(t) for t in TEXT)
    layout = tokenizer.encode_rendered_text(processing.prompt_text(*picture.size))
    keys = iter(image_keys(IMAGE_ID, layout.count(processing.image_token_id)))
    image = [next(keys) if t == processing.image_token_id else t for t in layout]
    first = [i for i, t in enumerate(image) if is_image_key(t)]
    tokenizer.close()
    return before + image + after, ImageInput(IMAGE_ID, len(before) + first[0], len(before) + first[-1] + 1,
                                              len(first), lambda: picture), tokenizer


@pytest.fixture(scope="module")
def smolvlm2(tmp_path_factory):
    return str(write(tmp_path_factory.mktemp("smolvlm2"), family="smolvlm2"))


@pytest.mark.numeric
@pytest.mark.parametrize("family", ["smolvlm", "smolvlm2"])
def test_logits_match_transformers_idefics3(family, request):
    import torch
    import transformers
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    smolvlm = request.getfixturevalue(family)

    picture = _picture(50, 40)  # larger than a tile (32): split in 2x2 tiles and the whole, downsized
    prompt, image, tokenizer = _prompt(smolvlm, picture)
    processing = tokenizer.vision
    placeholder = processing.image_token_id
    # transformers' own processor lays the prompt out the same way (SmolVLM's is Idefics3's but for its videos)
    config = json.loads((Path(smolvlm) / "config.json").read_text())
    processor = Idefics3Processor(processing.images, tokenizer.tokenizer, image_seq_len=image_seq_len(config))
    inputs = processor(text=TEXT[0] + "<image>" + TEXT[1], images=[[picture]], return_tensors="pt")
    ids = [placeholder if is_image_key(t) else t for t in prompt]
    assert inputs["input_ids"][0].tolist() == ids
    model_class = getattr(transformers, json.loads((Path(smolvlm) / "config.json").read_text())["architectures"][0])
    reference = model_class.from_pretrained(smolvlm, dtype=torch.float32).eval()
    forced = 7
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([ids + [forced]]), pixel_values=inputs["pixel_values"],
                         pixel_attention_mask=inputs["pixel_attention_mask"]).logits[0].numpy()

    backend = TorchBackend("cpu")
    backend.set_encoder_cache_bytes(1 << 20)
    info = backend.load(smolvlm, "float32")
    assert info.reads_images
    assert backend.encode_images([image], "tenant") == 1
    assert backend.encode_images([image], "tenant") == 0  # cached for the tenant
    assert backend.encode_images([image], "another") == 1  # never shared between tenants
    session = backend.open_session()
    cuts = (0, image.start + 3, image.start + 30, len(prompt))  # chunk ends inside the image's tiles
    model = Model.of(smolvlm)
    for a, b in zip(cuts, cuts[1:]):
        got = backend.to_numpy(backend.prefill([session], [prompt[a:b]]))[0]
        assert_logits_close(got, want[b - 1], kind=Kind.FORMS, model=model, context=b)
    got = backend.to_numpy(backend.decode([session], [forced]))[0]
    assert_logits_close(got, want[len(prompt)], kind=Kind.FORMS, model=model, context=len(prompt) + 1)
    backend.release_images([IMAGE_ID] * 3)
    with pytest.raises(ValueError, match="not encoded"):
        backend.prefill([backend.open_session()], [prompt])


def test_an_encoder_cache_of_0_keeps_nothing_but_pins_a_running_requests_images(smolvlm):
    prompt, image, _ = _prompt(smolvlm, _picture(20, 20))
    backend = TorchBackend("cpu")
    backend.set_encoder_cache_bytes(0)
    info = backend.load(smolvlm, "float32")
    hidden = json.loads((Path(smolvlm) / "config.json").read_text())["text_config"]["hidden_size"]
    assert info.image_token_bytes == hidden * 4  # float32 embeddings, counted in a request's reservation
    assert backend.encode_images([image], "tenant") == 1
    assert backend.encode_images([image], "tenant") == 1  # nothing kept for an image sent again
    backend.prefill([backend.open_session()], [prompt])  # the pinned encoding is read all the same
    backend.release_images([IMAGE_ID] * 2)


def test_keys_stay_above_the_vocabulary():
    keys = image_keys(2**40 - 1, 3)
    assert all(IMAGE_KEY_BASE <= k < 2**63 for k in keys)


def test_a_reuse_point_inside_an_image_moves_to_its_first_key():
    keys = image_keys(IMAGE_ID, 6)
    tiled = [1, 2, 9, *keys[:3], 9, *keys[3:], 3]  # text (9) between its tiles, as Idefics3 lays them
    # inside: where the next token is one of its keys but the first (a text token between tiles is text)
    assert [image_start(tiled, n) for n in range(len(tiled) + 1)] == [0, 1, 2, 3, 3, 3, 6, 3, 3, 3, 10, 11]
    source = Source.entry("e", tiled, 0)
    assert usable_upto(7, tiled, source) == 3  # shared through the first tile: the image is reused whole or not
    assert usable_upto(10, tiled + [4], source) == 10


PARTS_ONLY = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:{% for part in "
              "message['content'] %}{% if part['type'] == 'text' %} {{ part['text'] }}{% endif %}{% endfor %}"
              "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def test_a_template_that_reads_content_as_parts_gets_the_text_as_one(smolvlm):
    as_text = PromptTokenizer.load(smolvlm)
    as_parts = PromptTokenizer.load(smolvlm, PARTS_ONLY)  # SmolVLM's hub template reads a list of parts only
    try:
        assert not as_text.content_as_parts and as_parts.content_as_parts
        messages = [{"role": "user", "content": "what is on <|kvfork-image 00|> the screen"}]
        assert as_parts.render(messages, None, {}) == \
            "<|im_start|>User: what is on <|kvfork-image 00|> the screen<end_of_utterance>\nAssistant:"
    finally:
        as_text.close()
        as_parts.close()
