"""Token choice on the device, each row under its own request's settings and random stream.

The order and meaning are the MLX backend's (backends/mlx/sampling.py): a row's
grammar mask (`state.allowed`) sets the tokens it forbids to -inf; penalties
and logit bias shape the logits; greedy takes their argmax; otherwise
temperature, then top-k, top-p, min-p cut the distribution and the request's own
generator draws from it. Logprobs are the model's raw distribution's, as OpenAI
reports them. The pick is appended to `state.output`, which the penalties count.
All rows' picks come back to the host in one transfer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvfork.backends.vision.keys import text_only
from kvfork.backends.base import Sampled, SamplerState, SamplingParams, packed_masks


def _plain_greedy(p: SamplingParams) -> bool:
    return (
        p.greedy
        and not (p.logprobs or p.top_logprobs or p.logit_bias)
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
    )


def penalize(row: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """Repetition (over prompt and output, as in transformers), presence and frequency
    (over output, as in OpenAI), then the request's logit bias. Returns a new row."""
    p, row = state.params, row.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(text_only(state.prompt)) | set(state.output)), dtype=torch.long,
                            device=row.device)
        if len(seen):
            picked = row[seen]
            row[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and state.output:
        ids, counts = torch.tensor(state.output, device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
    return row


def truncate(scaled: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Drop the tokens top-k, top-p and min-p exclude (set them to -inf); the best one always stays."""
    if 0 < p.top_k < scaled.numel():
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        ordered, order = scaled.sort(descending=True)
        probs = ordered.softmax(-1)
        beyond = probs.cumsum(-1) - probs >= p.top_p  # mass before this token already reaches top_p
        scaled = scaled.scatter(0, order, ordered.masked_fill(beyond, float("-inf")))
    if p.min_p > 0.0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return scaled


def draw(row: torch.Tensor, state: SamplerState) -> torch.Tensor:
    p = state.params
    if p.greedy:
        return row.argmax()
    if state.rng is None:
        state.rng = torch.Generator(device=row.device)
        if p.seed is not None:
            state.rng.manual_seed(p.stream_seed)
        else:
            state.rng.seed()
    probs = truncate(row / p.temperature, p).softmax(-1)
    return torch.multinomial(probs, 1, generator=state.rng)[0]


def allow(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """The logits with each constrained row's forbidden tokens at -inf, masked on the device in one pass;
    `logits` itself when no row is constrained (then nothing is done at all)."""
    masks = packed_masks(states)
    if masks is None:
        return logits
    packed = torch.from_numpy(masks).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(states), -1)[:, : logits.shape[-1]]
    return logits.masked_fill(bits == 0, float("-inf"))


def select_rows(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    if list(rows) == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))


def sample(logits: torch.Tensor, states: Sequence[SamplerState]) -> list[Sampled]:
    logits = logits.float()
    picking = allow(logits, states)
    if all(_plain_greedy(s.params) for s in states):
        results = [Sampled(token) for token in picking.argmax(-1).tolist()]
    else:
        # A failed call leaves every stream as it was: a stream made here is dropped, one that
        # existed gets its state back (each row's draw may have advanced it before a later row failed).
        streams = [(s.rng, None if s.rng is None else s.rng.get_state()) for s in states]
        try:
            rows = [penalize(picking[i], s) for i, s in enumerate(states)]
            tokens = torch.stack([draw(row, s) for row, s in zip(rows, states)]).tolist()
            results = [Sampled(token) for token in tokens]
            for i, s in enumerate(states):
                if s.params.logprobs or s.params.top_logprobs:
                    _add_logprobs(results[i], logits[i], s.params.top_logprobs)
        except BaseException:
            for s, (rng, held) in zip(states, streams):
                s.rng = rng
                if rng is not None:
                    rng.set_state(held)
            raise
    for state, result in zip(states, results):
        state.output.append(result.token)
    return results


def _add_logprobs(result: Sampled, raw: torch.Tensor, top: int) -> None:
    logprobs = raw.log_softmax(-1)
    result.logprob = float(logprobs[result.token])
    if top:
        best = logprobs.topk(top)
        result.top_logprobs = list(zip(best.indices.tolist(), best.values.tolist()))
