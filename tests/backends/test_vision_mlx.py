"""A vision model on MLX (backends/mlx/vision.py): the tiny SmolVLM gives the same logits and greedy tokens on MLX
as on torch, an image in the prompt prefilled in chunks that cut its tiles, then decoded; a clone after the
image and a saved state continue alike; the families MLX does not read images of are refused, naming
--backend torch."""

from __future__ import annotations

import json

import pytest

from kvfork.backends.vision.keys import is_image_key
from test_vision import _picture, _prompt, smolvlm  # noqa: F401  (its fixture)
from tolerance import Kind, Model, assert_logits_close, assert_same_greedy

pytest.importorskip("mlx.core", exc_type=ImportError)

from kvfork.backends.base import BackendRefused  # noqa: E402
from kvfork.backends.mlx.backend import MLXBackend  # noqa: E402
from kvfork.backends.torch.backend import TorchBackend  # noqa: E402

STEPS = 6


def _greedy(backend, session, first_logits, steps: int = STEPS) -> tuple[list[int], list]:
    logits, tokens = [first_logits], [int(first_logits.argmax())]
    for _ in range(steps - 1):
        logits.append(backend.to_numpy(backend.decode([session], [tokens[-1]]))[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def _run(backend, folder: str, prompt: list[int], image, cuts: tuple[int, ...]) -> tuple[list, tuple, object]:
    """Prefill logits at each cut, the greedy continuation, and the session."""
    backend.load(folder, "float32")
    assert backend.info.reads_images and backend.encode_images([image], "tenant") == 1
    session = backend.open_session()
    ends = [backend.to_numpy(backend.prefill([session], [prompt[a:b]]))[0] for a, b in zip(cuts, cuts[1:])]
    return ends, _greedy(backend, session, ends[-1]), session


def test_mlx_and_torch_give_the_same_greedy_tokens(smolvlm):
    prompt, image, _ = _prompt(smolvlm, _picture(50, 40))
    cuts = (0, image.start + 3, image.start + 30, len(prompt))  # chunk ends inside the image's tiles
    mlx = MLXBackend()
    got_ends, got, session = _run(mlx, smolvlm, prompt, image, cuts)
    want_ends, want, _ = _run(TorchBackend("cpu"), smolvlm, prompt, image, cuts)
    model = Model.of(smolvlm)
    for end, g, w in zip(cuts[1:], got_ends, want_ends):
        assert_logits_close(g, w, kind=Kind.BACKENDS, model=model, context=end)
    assert assert_same_greedy(got, want, kind=Kind.BACKENDS, model=model, context=len(prompt) + STEPS) == STEPS

    # a clone at the prompt's end and a restored saved state continue as the session did
    clone = mlx.clone(session, len(prompt))
    restored = mlx.import_state(mlx.export_state(clone))
    for copy in (clone, restored):
        again = _greedy(mlx, copy, got[1][0])
        assert again[0] == got[0]
    mlx.release_images([image.image])
    assert any(is_image_key(t) for t in prompt)
    with pytest.raises(ValueError, match="not encoded"):
        mlx.prefill([mlx.open_session()], [prompt])


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_mlx_refuses_the_families_it_reads_no_images_of(family, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, "text_config": {}}))
    with pytest.raises(BackendRefused, match=f"{family}.*--backend torch"):
        MLXBackend().load(str(tmp_path))
