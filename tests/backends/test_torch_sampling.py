"""The torch sampler on hand-made logits, where the exact outcome is known. The sampling
contract shared with MLX (streams, greedy, bias, logprobs) is tests/backends/test_sampling.py."""

from __future__ import annotations

import os

import pytest
import torch

from kvfork.backends.base import SamplerState, SamplingParams
from kvfork.backends.torch.sampling import sample

DEVICE = os.environ.get("KVFORK_DEVICE", "cpu")
VOCAB = 64


def flat(rows: int = 1, seed: int = 0) -> torch.Tensor:
    """Near-uniform logits, so a random draw really is random."""
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)).mul(0.1).to(DEVICE)


def state(**kw) -> SamplerState:
    prompt, output = kw.pop("prompt", ()), kw.pop("output", [])
    return SamplerState(SamplingParams(**kw), prompt=prompt, output=output)


def draws(logits: torch.Tensor, s: SamplerState, n: int = 40) -> list[int]:
    return [sample(logits, [s])[0].token for _ in range(n)]


def test_top_p_and_min_p_cut_the_tail():
    logits = torch.full((1, VOCAB), 0.0, device=DEVICE)
    logits[0, 3], logits[0, 9] = 6.0, 5.0  # p(3) ~ 0.66, p(9) ~ 0.24, the rest share ~0.10
    assert set(draws(logits, state(temperature=1.0, seed=0, top_p=0.5))) == {3}
    assert set(draws(logits, state(temperature=1.0, seed=0, top_p=0.7))) == {3, 9}
    assert set(draws(logits, state(temperature=1.0, seed=0, min_p=0.3))) == {3, 9}
    assert len(set(draws(logits, state(temperature=1.0, seed=0), 200))) > 10


def test_penalties():
    logits = torch.zeros(1, VOCAB, device=DEVICE)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    assert sample(logits, [state(repetition_penalty=1.5, prompt=[5])])[0].token == 6  # 2 / 1.5 < 1.5
    assert sample(logits, [state(repetition_penalty=1.5, output=[6])])[0].token == 5
    assert sample(logits, [state(presence_penalty=1.0, output=[5])])[0].token == 6
    assert sample(logits, [state(frequency_penalty=0.2, output=[5])])[0].token == 5  # 2 - 0.2 > 1.5
    assert sample(logits, [state(frequency_penalty=0.2, output=[5, 5, 5])])[0].token == 6
    negative = -logits
    negative[0, 5] = -0.1  # best; repetition multiplies negatives, pushing it below the zeros
    assert sample(negative, [state(repetition_penalty=2.0, prompt=[5])])[0].token != 5


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="needs KVFORK_DEVICE=cuda")
def test_streams_live_on_the_device():
    s = state(temperature=1.0, seed=1)
    sample(flat(), [s])
    assert s.rng.device.type == "cuda"
