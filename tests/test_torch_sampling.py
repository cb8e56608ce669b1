"""The torch sampler on hand-made logits: every setting changes the pick the way it says."""

from __future__ import annotations

import math
import os

import pytest
import torch

from backends.base import SamplerState, SamplingParams
from backends.torch.sampling import sample

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


def test_greedy_is_argmax_per_row():
    logits = flat(5)
    assert [x.token for x in sample(logits, [state() for _ in range(5)])] == logits.argmax(-1).tolist()


def test_seed_replays_and_streams_are_per_request():
    logits = flat()
    a, b, c = state(temperature=1.0, seed=7), state(temperature=1.0, seed=7), state(temperature=1.0, seed=8)
    first = draws(logits, a)
    assert first == draws(logits, b)
    assert first != draws(logits, c)
    assert len(set(first)) > 5  # flat logits: a real draw, not a disguised argmax


def test_rows_of_one_batch_keep_their_own_settings():
    logits = flat(2)
    greedy, hot = state(), state(temperature=1.0, seed=1, top_k=1)
    picks = sample(logits, [greedy, hot])
    assert [p.token for p in picks] == logits.argmax(-1).tolist()  # top_k=1 leaves only the argmax


def test_top_p_and_min_p_cut_the_tail():
    logits = torch.full((1, VOCAB), 0.0, device=DEVICE)
    logits[0, 3], logits[0, 9] = 6.0, 5.0  # p(3) ~ 0.66, p(9) ~ 0.24, the rest share ~0.10
    assert set(draws(logits, state(temperature=1.0, seed=0, top_p=0.5))) == {3}
    assert set(draws(logits, state(temperature=1.0, seed=0, top_p=0.7))) == {3, 9}
    assert set(draws(logits, state(temperature=1.0, seed=0, min_p=0.3))) == {3, 9}
    assert len(set(draws(logits, state(temperature=1.0, seed=0), 200))) > 10


def test_top_k_limits_the_choice():
    logits = flat()
    top4 = set(logits[0].topk(4).indices.tolist())
    picked = set(draws(logits, state(temperature=1.0, seed=3, top_k=4), 100))
    assert picked <= top4 and len(picked) > 1


def test_logit_bias_forces_and_forbids():
    logits = flat()
    assert sample(logits, [state(logit_bias={17: 100.0})])[0].token == 17
    best = int(logits.argmax())
    assert sample(logits, [state(logit_bias={best: -100.0})])[0].token != best


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


def test_logprobs_and_top_logprobs():
    logits = flat()
    picked = sample(logits, [state(logprobs=True, top_logprobs=3)])[0]
    expected = torch.log_softmax(logits[0].float(), -1)
    assert math.isclose(picked.logprob, float(expected[picked.token]), abs_tol=1e-5)
    assert [t for t, _ in picked.top_logprobs] == expected.topk(3).indices.tolist()
    assert picked.top_logprobs[0][1] >= picked.top_logprobs[1][1] >= picked.top_logprobs[2][1]
    assert sample(logits, [state()])[0].logprob is None


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="needs KVFORK_DEVICE=cuda")
def test_streams_live_on_the_device():
    s = state(temperature=1.0, seed=1)
    sample(flat(), [s])
    assert s.rng.device.type == "cuda"
