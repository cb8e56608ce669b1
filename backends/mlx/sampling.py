"""Sampling on the device, each row under its own request's settings and stream.

Order (the torch backend follows it too): a row's grammar mask (`state.allowed`)
sets the tokens it forbids to -inf; penalties and logit_bias shape the
logits; greedy takes their argmax; otherwise temperature, then top_k, top_p,
min_p cut the distribution and the request's own key draws from it. Logprobs
are those of the model's raw distribution (before penalties, bias and
temperature), as OpenAI reports them. The chosen token is appended to
`state.output`, which is what presence/frequency penalties count.
"""

from __future__ import annotations

import secrets
from collections import Counter
from typing import Sequence

import mlx.core as mx

from kvfork.backends.vision.keys import text_only
from kvfork.backends.base import Sampled, SamplerState, SamplingParams, packed_masks


def _plain(p: SamplingParams) -> bool:
    """Greedy with nothing that changes the argmax or asks for logprobs."""
    shaped = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logit_bias
    return p.greedy and not shaped and not p.logprobs and not p.top_logprobs


def shaped_logits(row: mx.array, state: SamplerState) -> mx.array:
    """Penalties and bias applied to one row of logits [vocab]."""
    p = state.params
    if p.repetition_penalty != 1.0:
        seen = mx.array(sorted(set(text_only(state.prompt)) | set(state.output)), mx.int32)
        if seen.size:
            picked = row[seen]
            row[seen] = mx.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and state.output:
        counts = Counter(state.output)
        ids = mx.array(list(counts), mx.int32)
        row[ids] = row[ids] - (p.presence_penalty + p.frequency_penalty * mx.array(list(counts.values()), mx.float32))
    if p.logit_bias:
        ids = mx.array(list(p.logit_bias), mx.int32)
        row[ids] = row[ids] + mx.array(list(p.logit_bias.values()), mx.float32)
    return row


def truncated(row: mx.array, p: SamplingParams) -> mx.array:
    """Temperature-scaled logits with the tokens top_k, top_p and min_p drop set to -inf."""
    row = row / p.temperature
    drop = mx.array(-float("inf"), row.dtype)
    if 0 < p.top_k < row.shape[-1]:
        kth = mx.sort(row)[-p.top_k]
        row = mx.where(row >= kth, row, drop)
    if p.top_p < 1.0:
        probs = mx.softmax(row)
        descending = mx.sort(probs)[::-1]
        kept = (mx.cumsum(descending) - descending) < p.top_p  # always keeps the first
        floor = descending[mx.sum(kept) - 1]
        row = mx.where(probs >= floor, row, drop)
    if p.min_p > 0.0:
        probs = mx.softmax(row)
        row = mx.where(probs >= p.min_p * mx.max(probs), row, drop)
    return row


def _next_key(state: SamplerState) -> mx.array:
    if state.rng is None:
        seed = state.params.stream_seed if state.params.seed is not None else secrets.randbits(63)
        state.rng = mx.random.key(seed)
    state.rng, key = mx.random.split(state.rng)
    return key


def allow(logits: mx.array, states: Sequence[SamplerState]) -> mx.array:
    """The logits with each constrained row's forbidden tokens at -inf, masked on the device in one pass;
    `logits` itself when no row is constrained (then nothing is done at all)."""
    masks = packed_masks(states)
    if masks is None:
        return logits
    packed = mx.array(masks)
    bits = ((packed[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1).reshape(len(states), -1)
    return mx.where(bits[:, : logits.shape[-1]] == 1, logits, mx.array(-float("inf"), logits.dtype))


def select_rows(logits: mx.array, rows: Sequence[int]) -> mx.array:
    if list(rows) == list(range(logits.shape[0])):
        return logits
    return mx.take(logits, mx.array(rows, mx.int32), axis=0)


def sample(logits: mx.array, states: Sequence[SamplerState]) -> list[Sampled]:
    logits = logits.astype(mx.float32)
    picking = allow(logits, states)
    if all(_plain(s.params) for s in states):
        tokens = mx.argmax(picking, axis=-1).tolist()
        results = [Sampled(t) for t in tokens]
    else:
        keys = [s.rng for s in states]  # immutable arrays: holding them is the whole snapshot
        try:
            results = _sample_rows(picking, logits, states)
        except BaseException:
            for state, key in zip(states, keys):  # a failed call leaves every stream as it was
                state.rng = key
            raise
    for state, result in zip(states, results):
        state.output.append(result.token)
    return results


def _sample_rows(picking: mx.array, logits: mx.array, states: Sequence[SamplerState]) -> list[Sampled]:
    """Row by row: `picking` (masked) is what the pick is drawn from, `logits` (raw) what logprobs report."""
    picks, logprobs, tops = [], [], []
    for i, state in enumerate(states):
        p = state.params
        raw = logits[i]
        row = shaped_logits(mx.array(picking[i]), state)
        if p.greedy:
            token = mx.argmax(row)
        else:
            token = mx.random.categorical(truncated(row, p), key=_next_key(state))
        picks.append(token)
        if p.logprobs or p.top_logprobs:
            lp = raw - mx.logsumexp(raw)
            logprobs.append(lp[token])
            order = mx.argsort(-lp)[: p.top_logprobs]
            tops.append((order, lp[order]))
        else:
            logprobs.append(None)
            tops.append(None)
    mx.eval(picks, [x for x in logprobs if x is not None], [t for t in tops if t is not None])
    out = []
    for token, lp, top in zip(picks, logprobs, tops):
        result = Sampled(int(token.item()))
        if lp is not None:
            result.logprob = float(lp.item())
            if top[0].size:
                result.top_logprobs = list(zip(top[0].tolist(), top[1].tolist()))
        out.append(result)
    return out
