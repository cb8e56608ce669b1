"""A vision model on MLX (backends/mlx/vision.py): the tiny SmolVLM (SmolVLM2 too), Gemma 3 and Qwen2.5-VL give
the same logits and greedy tokens on MLX as on torch, their images in the prompt prefilled in chunks (SmolVLM's
cutting its tiles, Gemma's around its images, whose tokens attend each other both ways, Qwen's inside its images,
placed by M-RoPE), then decoded; a clone after the image and a saved state continue alike; a family MLX does not
read images of is refused, naming --backend torch."""

from __future__ import annotations

import json

import pytest

from kvfork.backends.vision.keys import is_image_key
from test_vision import _picture, _prompt, smolvlm, smolvlm2  # noqa: F401  (its fixtures)
from test_vision_families import Case, family_dir  # noqa: F401  (its fixture)
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


def _run(backend, prompt: list[int], images: list, cuts: tuple[int, ...]) -> tuple[list, tuple, object]:
    """Prefill logits at each cut, the greedy continuation, and the session."""
    assert backend.info.reads_images and backend.encode_images(images, "mlx-test") == len(images)
    session = backend.open_session()
    ends = [backend.to_numpy(backend.prefill([session], [prompt[a:b]]))[0] for a, b in zip(cuts, cuts[1:])]
    return ends, _greedy(backend, session, ends[-1]), session


def _same(mlx, torch_backend, folder, prompt: list[int], images: list, cuts: tuple[int, ...]) -> None:
    """MLX against torch: logits at each cut, greedy tokens; then a clone of the session and a restored saved
    state of it continue as the session does."""
    got_ends, got, session = _run(mlx, prompt, images, cuts)
    want_ends, want, _ = _run(torch_backend, prompt, images, cuts)
    model = Model.of(folder)
    for end, g, w in zip(cuts[1:], got_ends, want_ends):
        assert_logits_close(g, w, kind=Kind.BACKENDS, model=model, context=end)
    assert assert_same_greedy(got, want, kind=Kind.BACKENDS, model=model, context=len(prompt) + STEPS) == STEPS
    clone = mlx.clone(session, session.position)
    restored = mlx.import_state(mlx.export_state(clone))
    after = [_greedy(mlx, s, mlx.to_numpy(mlx.decode([s], [got[0][-1]]))[0], 3)[0] for s in (session, clone, restored)]
    assert after[0] == after[1] == after[2]


@pytest.mark.parametrize("family", ["smolvlm", "smolvlm2"])
def test_smolvlm_on_mlx_gives_torchs_tokens(family, request):
    smolvlm = request.getfixturevalue(family)
    prompt, image, _ = _prompt(smolvlm, _picture(50, 40))
    mlx, torch_backend = MLXBackend(), TorchBackend("cpu")
    for backend in (mlx, torch_backend):
        backend.load(smolvlm, "float32")
    _same(mlx, torch_backend, smolvlm, prompt, [image], (0, image.start + 3, image.start + 30, len(prompt)))
    mlx.release_images([image.image])
    assert any(is_image_key(t) for t in prompt)
    with pytest.raises(ValueError, match="not encoded"):
        mlx.prefill([mlx.open_session()], [prompt])


def test_gemma3_on_mlx_gives_torchs_tokens(family_dir):
    import torch

    case = Case("gemma3", family_dir("gemma3"))
    mlx = MLXBackend()
    mlx.load(str(case.folder), "float32")
    # the tiny model's projector starts at zero (transformers' init): its images would all read as zeros
    projection = torch.randn_like(case.backend.vision.tower.multi_modal_projector.mm_input_projection_weight)
    for tower in (case.backend.vision.tower, mlx.vision.reader.tower):
        tower.multi_modal_projector.mm_input_projection_weight.data.copy_(projection)
    _same(mlx, case.backend, case.folder, case.tokens, case.inputs, (0, *case.cuts()))


def test_qwen2_5_vl_on_mlx_gives_torchs_tokens(family_dir):
    """M-RoPE: the text after each image continues from the image's positions, in prefill, decode, a clone and
    a restored state (whose shifts travel with it)."""
    case = Case("qwen2_5_vl", family_dir("qwen2_5_vl"))
    mlx = MLXBackend()
    mlx.load(str(case.folder), "float32")
    _same(mlx, case.backend, case.folder, case.tokens, case.inputs, (0, *case.cuts()))
    # decode rows of other shifts in one batch step: the image prompt's and a text prompt's, each as alone
    sessions = [mlx.open_session() for _ in range(2)]
    for session, prompt in zip(sessions, (case.tokens, [5, 6, 7])):
        mlx.prefill([session], [prompt])
    clones = [mlx.clone(s, s.position) for s in sessions]
    together = mlx.to_numpy(mlx.decode(sessions, [9, 9]))
    for row, clone in enumerate(clones):
        assert_logits_close(together[row], mlx.to_numpy(mlx.decode([clone], [9]))[0], kind=Kind.BATCHED,
                            model=Model.of(case.folder), context=clone.position)


def test_mlx_refuses_the_families_it_reads_no_images_of(tmp_path, monkeypatch):
    from kvfork.backends.mlx import vision

    family = "qwen2_5_vl"
    monkeypatch.setattr(vision, "SERVED", tuple(f for f in vision.SERVED if f != family))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, "text_config": {}}))
    with pytest.raises(BackendRefused, match=f"{family}.*--backend torch"):
        MLXBackend().load(str(tmp_path))
