"""One model on 2 ranks (tensor parallel), through the backend interface: every reuse operation gives
what one process gives, and each rank holds half the weights and half of every KV state.

One launch per backend runs tests/distributed_scenario.py on every tiny model in turn (the launches
are the expensive part on a shared 2-core machine); the tests read its records.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvfork.backends import create_backend
from kvfork.backends.torch.config import parse_config
from kvfork.backends.torch.parallel import refusal
from distributed_harness import (DISTRIBUTED_BACKENDS, LOGIT_SCALE, REPO, launched, log_text, rank_env, stop_group,
                                 wait_exit)
from distributed_scenario import figures, scenario
from tiny_models import CONFIGS, write_model
from tolerance import Kind, Model, assert_same_greedy

pytestmark = pytest.mark.distributed

# Intermediate 512: the MLP outweighs what stays whole on every rank (norms; mlx-lm's tied embedding)
# enough that "about half the weights" cannot pass for a rank that holds them all.
WIDE = dict(intermediate_size=512)
SPLIT = {"torch": ("llama", "qwen3", "gemma3", "qwen3_5"), "mlx": ("llama", "qwen3", "qwen3_5")}
# The default model's shape (SmolLM2-135M: 9 heads, 3 KV heads) does not split over 2 ranks.
NINE_HEADS = dict(hidden_size=144, intermediate_size=384, num_attention_heads=9, num_key_value_heads=3, head_dim=16)
REFUSED = {"torch": (), "mlx": ("gemma3",)}  # mlx-lm cannot split gemma3_text (kvfork does not shard MLX models)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_hybrid_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("distributed-models")
    out = {arch: str(write_model(root / arch, arch, **WIDE)) for arch in CONFIGS}
    out["nine_heads"] = str(write_model(root / "nine_heads", "llama", **NINE_HEADS))
    out["qwen3_5"] = tiny_hybrid_dir("qwen3_5", "hf")
    return out


@pytest.fixture(scope="module", params=DISTRIBUTED_BACKENDS)
def two_ranks(request, folders, tmp_path_factory) -> tuple[str, dict, dict]:
    """(backend, rank 0's record, rank 1's record), per model folder."""
    name = request.param
    if name == "mlx":
        pytest.importorskip("mlx_lm")  # a GPU machine's check (tools/gpu_check.sh) has torch alone
    out = tmp_path_factory.mktemp(f"scenario-{name}")
    models = [folders["nine_heads"], *(folders[a] for a in SPLIT[name] + REFUSED[name])]
    log = out / "launch.log"
    proc = launched(name, [str(REPO / "tests" / "distributed_scenario.py"), name, str(out), *models],
                    rank_env(name, out / "home"), log)
    try:
        code = wait_exit(proc, 900)
    finally:
        stop_group(proc)
    assert code == 0 and (out / "rank0.json").exists(), log_text(log)[-4000:]  # mlx.launch exits 0 all the same
    return name, json.loads((out / "rank0.json").read_text()), json.loads((out / "rank1.json").read_text())


def reference(name: str, folder: str) -> dict:
    backend = create_backend(name)
    backend.load(folder, "float32")
    return {**scenario(backend), **figures(backend)}


# The scenario's longest context: a 70-token prompt, its first token, 4 decodes, 2 more after an import.
CONTEXT = 80


def assert_same_run(got: dict, want: dict, arch: str, folder: str) -> None:
    """Call by call, row by row: the same greedy tokens, as tolerance.py asserts them (logits within
    the bound, tokens equal unless the one-process run's top two were within twice it). Past a
    near tie the two runs may rightly pick different tokens, and what follows them differs: the
    comparison stops there."""
    model = Model.of(folder)
    for g, w in zip(got["steps"], want["steps"], strict=True):
        what = f"{arch}: {w['what']}"
        assert g["what"] == w["what"]
        if "logits" not in w:  # a clone: refused alike, or made at the same position
            assert g == w, what
            continue
        want_logits = np.array(w["logits"])
        assert np.abs(want_logits).max() <= LOGIT_SCALE, f"{what}: logits past the harness's LOGIT_SCALE"
        for row, (got_token, want_token) in enumerate(zip(g["tokens"], w["tokens"], strict=True)):
            agreed = assert_same_greedy(([got_token], [g["logits"][row]]), ([want_token], [w["logits"][row]]),
                                        kind=Kind.RANKS, model=model, context=CONTEXT)
            if not agreed:
                return


def test_two_ranks_give_one_process_tokens(two_ranks, folders):
    """llama, qwen3, qwen3_5 (recurrent layers: checkpoints, clones at them) on both; gemma3 (sliding
    layers) on torch."""
    name, rank0, _ = two_ranks
    for arch in SPLIT[name]:
        assert_same_run(rank0[folders[arch]], reference(name, folders[arch]), arch, folders[arch])


def test_each_rank_holds_half(two_ranks, folders):
    name, rank0, rank1 = two_ranks
    for arch in SPLIT[name]:
        want = reference(name, folders[arch])
        for held in (rank0[folders[arch]], rank1[folders[arch]]):
            assert 0.4 < held["weight_bytes"] / want["weight_bytes"] < 0.6, arch
            assert held["kv_bytes_per_token"] * 2 == want["kv_bytes_per_token"], arch
            assert held["state_bytes"] * 2 == want["state_bytes"], arch
        assert 0.4 < rank0[folders[arch]]["session_bytes"] / want["session_bytes"] < 0.6, arch


def test_releases_reach_every_rank(two_ranks, folders):
    """Rank 0 released every session (a cancel among them): so did rank 1, and both hold nothing."""
    name, rank0, rank1 = two_ranks
    for arch in SPLIT[name]:
        assert rank0[folders[arch]]["live_after"] == rank1[folders[arch]]["live_after"] == 0
        assert rank0[folders[arch]]["total_after"] == 0


def test_refused_at_load(two_ranks, folders):
    """Both ranks refuse, with the reason, what cannot split: the default model's head counts, and on MLX
    the families mlx-lm has no sharding for."""
    name, rank0, rank1 = two_ranks
    for record in (rank0, rank1):
        assert "9 attention heads, 3 KV heads: not a multiple of 2" in record[folders["nine_heads"]]["error"]
        for arch in REFUSED[name]:
            assert "mlx-lm has no tensor-parallel sharding (Model.shard) for model_type 'gemma3_text'" in \
                record[folders[arch]]["error"]


def test_refusals_name_the_counts_that_do_not_divide(folders):
    """Where a check can be made without a second rank: the reasons, for any rank count."""
    config = json.loads((Path(folders["nine_heads"]) / "config.json").read_text())
    assert "9 attention heads, 3 KV heads: not a multiple of 2" in refusal(parse_config(config), 2)
    assert refusal(parse_config(config), 3) is None
    assert "MLP columns" in refusal(parse_config(dict(config, intermediate_size=130)), 3)
    hybrid = json.loads((Path(folders["qwen3_5"]) / "config.json").read_text())
    assert refusal(parse_config(hybrid), 2) is None
    assert "2 DeltaNet key heads" in refusal(parse_config(hybrid), 4)
    split_refusal = pytest.importorskip("kvfork.backends.mlx.loading").split_refusal
    assert "gemma3_text" in split_refusal(Path(folders["gemma3"]), 2)
    assert split_refusal(Path(folders["nine_heads"]), 3) is None
