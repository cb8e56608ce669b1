"""The step as data: every backend effect of one runner step, as a plain value.

    StepPlan     what one step runs: the session ops since the last forward pass (`ops`,
                 backends/effects.py values, in the order they ran), the samplers opened, the
                 decode rows and prefill chunks of its forward pass(es), and which rows are
                 sampled by which sampler
    pass_of(rows) -> Prefill | Decode     the backend call that runs one pass's rows
    to_bytes(plan) -> bytes, from_bytes(data) -> StepPlan     msgpack, through msgspec
    replay(plans, backend) -> {rid: tokens}    run recorded plans again, on a fresh backend

Design rules:
- sessions are named by ids the runner gives them (`sid`, Executor.new_sid), never by
  object, so a plan runs from itself alone (`replay`);
- an op is recorded once it ran: a clone the backend refused changed nothing and is not
  in the plan; a clone that ran after the last pass of step k (a capture, a choice, a
  follower's order, a release) is among step k + 1's `ops`, which run before its pass;
- the rows of a pass: every decode row and prefill chunk in one `prefill` call on a
  backend with `mixed_batches` (torch), else the decode rows (drafted ones among them), then the
  prefill chunks;
- the plan is what the runner decided before its forward pass; a forward pass that fails
  is recovered from by faults.py (the plan is not rewritten for it: the ranks of one model
  follow the backend calls themselves, backends/lockstep, retries included);
- sampling reads the plan's rows' logits only; a decode row carries the token it
  commits, so the next step runs from the plan alone;
- speculation: a decode row may carry drafted tokens after the one it commits (`Row.reads`
  = 1 + drafted) and its pass is one `verify` call reading each of their positions' logits
  (with the plain decode rows, whether or not the backend has mixed_batches); its
  sampler walks them while the draw equals the draft, and the rest is rolled back by a
  `Truncate` op, among the next step's ops like every op run after a pass.
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from kvfork.backends import effects
from kvfork.backends.base import Backend, SamplerState, SamplingParams
from kvfork.backends.effects import Decode, Executor, Op, Prefill, Verify


class Row(msgspec.Struct, frozen=True):
    """One row of a forward pass: a prefill chunk, or a decode row: the token it commits, then the
    tokens drafted to follow it (speculation), each position's logits read (`reads`)."""

    rid: int  # the request it belongs to
    sid: int
    tokens: list[int]
    logits: bool  # its last logits are read: a decode row, or the chunk that ends its prompt
    prefill: bool
    reads: int = 1  # logits rows it gives: its last `reads` positions' (a decode row with k drafted: k + 1)

    @property
    def draft(self) -> list[int]:
        return self.tokens[1:] if not self.prefill else []


class Sampler(msgspec.Struct, frozen=True):
    """A request's sampler, opened this step (its stream starts at its seed)."""

    rid: int
    params: SamplingParams
    prompt: list[int]


class Sample(msgspec.Struct, frozen=True):
    rid: int  # whose sampler picks
    row: int  # the request whose row's logits it reads (its own, or its lead's: n choices)


class StepPlan(msgspec.Struct):
    step: int
    ops: list[Op] = []
    samplers: list[Sampler] = []
    decode: list[Row] = []
    prefill: list[Row] = []
    samples: list[Sample] = []
    mixed: bool = False  # one pass of every row (Backend.mixed_batches), else decode then prefill

    def passes(self) -> list[list[Row]]:
        if self.mixed:
            return [self.decode + self.prefill] if self.decode or self.prefill else []
        return [rows for rows in (self.decode, self.prefill) if rows]

    @property
    def prefill_tokens(self) -> int:
        return sum(len(row.tokens) for row in self.prefill)


def pass_of(rows: Sequence[Row]) -> Prefill | Verify | Decode:
    """One `verify` call when a decode row carries a draft, else one `prefill` call when any row is a
    prefill chunk (with the decode rows, on a mixed_batches backend), else one `decode` call."""
    sids = [row.sid for row in rows]
    if any(row.reads > 1 for row in rows):
        return Verify(sids, [row.tokens for row in rows], [row.reads for row in rows])
    if any(row.prefill for row in rows):
        return Prefill(sids, [row.tokens for row in rows])
    return Decode(sids, [row.tokens[0] for row in rows])


def offsets(rows: Sequence[Row | None]) -> list[int]:
    """The logits row each pass row's reads start at (a row nobody reads, None, took one)."""
    out, at = [], 0
    for row in rows:
        out.append(at)
        at += row.reads if row is not None else 1
    return out


_decode = effects.decoder(StepPlan)


def to_bytes(plan: StepPlan) -> bytes:
    return effects.encode(plan)


def from_bytes(data: bytes) -> StepPlan:
    return _decode(data)


def replay(plans: Sequence[StepPlan], backend: Backend) -> dict[int, list[int]]:
    """Run recorded plans on `backend` (loaded, holding no session of theirs); the tokens each
    request's sampler picks, by rid."""
    ex = Executor(backend)
    samplers: dict[int, SamplerState] = {}
    picked: dict[int, list[int]] = {}
    for plan in plans:
        for op in plan.ops:
            ex.run(op)
        for s in plan.samplers:
            samplers[s.rid] = SamplerState(s.params, prompt=s.prompt)
        for rows in plan.passes():
            logits = ex.run(pass_of(rows))
            at = {row.rid: (i, row.draft) for i, row in zip(offsets(rows), rows)}
            for s in plan.samples:
                if s.row in at:
                    i, draft = at[s.row]
                    for j in range(len(draft) + 1):  # a drafted row: while the draw equals the draft (Speculation.walk)
                        picked.setdefault(s.rid, []).append(ex.sample(logits, [samplers[s.rid]], [i + j])[0].token)
                        if j == len(draft) or picked[s.rid][-1] != draft[j]:
                            break
    return picked
