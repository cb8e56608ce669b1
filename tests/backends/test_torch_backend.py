"""What only the torch backend has: stepwise buffer growth, HF config reading, in-memory install.
The backend contract itself (clone, sliding rule, batching, bytes) is tests/backends/test_contract.py."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from backend_fixtures import assert_close, lent, load
from kvfork.backends.torch import kv
from kvfork.backends.torch.backend import TorchBackend
from kvfork.backends.torch.loading import read_weights
from kvfork.backends.model_info import read_model_facts
from kvfork.backends.torch.config import parse_config, read_config
from tolerance import Kind

DEVICE = os.environ.get("KVFORK_DEVICE", "cpu")


@pytest.fixture
def llama(request, tiny_model_dir) -> TorchBackend:
    """A loaded float32 backend (backend_fixtures.lent)."""
    yield from lent(request, ("torch", "llama", DEVICE), lambda: load(TorchBackend(DEVICE), tiny_model_dir("llama")))


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def last_logits(b: TorchBackend, prompt: list[int], chunks: tuple[int, ...]) -> np.ndarray:
    session, start = b.open_session(), 0
    for n in chunks:
        got = b.to_numpy(b.prefill([session], [prompt[start : start + n]]))[0]
        start += n
    b.release(session)
    return got


@pytest.mark.numeric
@pytest.mark.parametrize("chunks", [(255, 1, 44), (200, 56, 1, 43), (1,) * 3 + (297,)])
def test_buffers_grow_in_blocks_without_changing_answers(llama, chunks):
    """A session of n tokens holds exactly kv.capacity(n) slots per full layer: whole blocks,
    one free slot at least (the cost function the budget is computed from)."""
    prompt, session, start = tokens(50, sum(chunks)), llama.open_session(), 0
    assert llama.session_bytes(session) == kv.BLOCK_TOKENS * llama.info.kv.full_bytes_per_token
    for n in chunks:
        llama.prefill([session], [prompt[start : start + n]])
        start += n
        assert llama.session_bytes(session) == kv.capacity(start) * llama.info.kv.full_bytes_per_token
    assert [kv.capacity(n) for n in (0, 255, 256, 300)] == [256, 256, 512, 512]
    assert [llama.info.kv.positions(n) for n in (0, 255, 256, 300)] == [256, 256, 512, 512]  # the budget's figure
    llama.release(session)
    assert_close(llama, last_logits(llama, prompt, chunks), last_logits(llama, prompt, (300,)), Kind.CHUNKED, context=300)


def test_a_clone_has_room_to_grow(llama):
    """A tightly sized clone would reallocate on its first write; capacity() leaves it a free slot."""
    donor = llama.open_session()
    llama.prefill([donor], [tokens(51, kv.BLOCK_TOKENS)])
    clone = llama.clone(donor, kv.BLOCK_TOKENS)
    # its own: the next block (the one it reads is the donor's)
    assert llama.session_bytes(clone) == kv.BLOCK_TOKENS * llama.info.kv.full_bytes_per_token
    buffers = [t.data_ptr() for t in clone.table.tensors()]
    llama.decode([clone], [7])
    assert [t.data_ptr() for t in clone.table.tensors()] == buffers
    llama.release(donor)
    llama.release(clone)


def test_a_released_session_cannot_be_cloned(llama):
    session = llama.open_session()
    llama.prefill([session], [tokens(53, 5)])
    llama.release(session)
    with pytest.raises(ValueError, match="released"):
        llama.clone(session, 3)


def test_install_from_memory_equals_load(llama, tiny_model_dir):
    folder = tiny_model_dir("llama")
    other = TorchBackend(DEVICE)
    other.install(read_config(folder), read_weights(Path(folder), torch.device(DEVICE)), "mem",
                  read_model_facts(folder), "float32")
    prompt = tokens(52, 20)
    np.testing.assert_array_equal(last_logits(other, prompt, (20,)), last_logits(llama, prompt, (20,)))


BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)


def test_rope_theta_from_rope_parameters_or_top_level():
    nested = parse_config(dict(BASE, model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 100000.0}))
    assert nested.rope_full.theta == 100000.0 and nested.rope_full.scaling is None
    assert parse_config(dict(BASE, model_type="llama", rope_theta=5e5)).rope_full.theta == 5e5
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "original_max_position_embeddings": 8192}
    assert parse_config(dict(BASE, model_type="llama", rope_parameters=llama3)).rope_full.scaling["factor"] == 8.0


def test_gemma3_layer_kinds_and_ropes():
    gemma = dict(BASE, model_type="gemma3_text", head_dim=8, sliding_window=32, query_pre_attn_scalar=64)
    by_pattern = parse_config(dict(gemma, sliding_window_pattern=2))
    assert by_pattern.sliding == (32, None, 32, None)
    kinds = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    assert parse_config(dict(gemma, layer_types=kinds)).sliding == (32, None, None, 32)
    assert by_pattern.rope_full.theta == 1e6 and by_pattern.rope_sliding.theta == 1e4 and by_pattern.attn_scale == 64**-0.5
    per_kind = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    cfg = parse_config(dict(gemma, rope_parameters=per_kind))
    assert cfg.rope_full.scaling["factor"] == 8.0 and cfg.rope_sliding == by_pattern.rope_sliding


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match="model_type"):
        parse_config(dict(BASE, model_type="mamba"))
