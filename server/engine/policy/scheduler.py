"""Decode-first continuous batching, as pure functions (no threads, no arrays).

Design rules:
- every decoding request advances one token each step, in one batched call;
  latency of running requests never waits on a newcomer's prompt;
- the rest of the step's token budget goes to prefill chunks, handed out in
  rotation so a long prompt cannot starve a shorter one behind it;
- a step that decodes also keeps to a time budget (--max-step-ms): prefill gets
  the tokens that fit in what the decode rows leave of it (the step's measured
  fixed part and per-token cost, rates.py). When the decode rows leave little,
  prefill still gets time as long as theirs, within 1.25x the budget, and never
  less than a quarter of the step nor MIN_PREFILL_TOKENS; decode rows that alone
  pass the budget share the step half and half with prefill. So a waiting prompt
  always progresses (no starving), its TTFT stays within about 2x of no budget,
  and the decoders' steps stay near the budget where it can be kept. Chunk ends by
  precedence: a follower's clone point, then the time budget, within
  --prefill-chunk and --max-batch-tokens (hard caps); then off any image it would
  cut whose tokens attend each other both ways (Gemma 3): back to the image's
  start, or, where the image begins the chunk, on to its end (one image is one
  chunk, whatever the caps: its tokens cannot be computed apart);
- admission is first come, first served: a head that does not fit the KV budget
  waits (the prefix cache gives way first), one that never could is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Running:
    """What the scheduler needs to know of one request in an inference slot."""

    rid: int  # admission order: smaller is older
    prefill_left: int  # prompt tokens not yet committed; 0 once decoding
    prefill_cap: int | None = None  # most tokens this step: a follower's clone point stops the chunk
    # [start, end) of each image a chunk must hold whole, counted from the next prompt token, in order
    whole: tuple[tuple[int, int], ...] = ()


# The floor of prefill progress in a step that decodes, whatever the measured rates say: a rate
# misread (a noisy step, a machine that slowed down) can never stall a prompt.
MIN_PREFILL_TOKENS = 16
# How far past the budget a step may go to keep prefilling at half speed when the decode rows
# alone take most of it.
STRETCH = 1.25


@dataclass(frozen=True)
class TimeBudget:
    """A step's time budget, with the measured rates that turn it into prefill tokens."""

    max_step_s: float
    decode_s: float  # what the step takes without prefill (decode rows and the pass's fixed part)
    s_per_token: float  # what each prefill token adds to it

    def prefill_s(self) -> float:
        """Prefill's share of the step: what the decode rows leave of the budget; else as long as
        they take (the prompt at no less than half its speed), as far as STRETCH x the budget allows,
        and never under a quarter of the step. Decode rows that alone take the whole budget cannot
        keep it, whatever prefill gives up: the two then share the step half and half."""
        budget, decode = self.max_step_s, self.decode_s
        if decode >= budget:
            return decode
        return max(budget - decode, min(decode, STRETCH * budget - decode), decode / 3)

    def prefill_tokens(self) -> int:
        return max(MIN_PREFILL_TOKENS, int(self.prefill_s() / max(self.s_per_token, 1e-9)))


@dataclass
class Schedule:
    decode: list[int] = field(default_factory=list)  # rids
    prefill: list[tuple[int, int]] = field(default_factory=list)  # (rid, tokens this step)
    last_prefilled: int | None = None  # rotation cursor for the next step

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


def plan_step(running: Sequence[Running], max_batch_tokens: int, prefill_chunk: int,
              last_prefilled: int | None = None, time_budget: TimeBudget | None = None, drafted: int = 0) -> Schedule:
    """`drafted`: tokens the decode rows carry after their own (speculation), out of the same token budget."""
    schedule = Schedule(decode=[r.rid for r in running if r.prefill_left == 0], last_prefilled=last_prefilled)
    budget = max_batch_tokens - len(schedule.decode) - drafted
    if schedule.decode and time_budget is not None:  # nobody waits on a step that only prefills
        budget = min(budget, time_budget.prefill_tokens())
    waiting = sorted((r for r in running if r.prefill_left > 0), key=lambda r: r.rid)
    if last_prefilled is not None:  # rotate: start after the one served last
        cut = next((i for i, r in enumerate(waiting) if r.rid > last_prefilled), 0)
        waiting = waiting[cut:] + waiting[:cut]
    for r in waiting:
        if budget <= 0:
            break
        n = chunk_outside(min(prefill_chunk, r.prefill_left, budget, r.prefill_cap or r.prefill_left), r.whole)
        schedule.prefill.append((r.rid, n))
        schedule.last_prefilled = r.rid
        budget -= n
    return schedule


def chunk_outside(n: int, whole: Sequence[tuple[int, int]]) -> int:
    """A chunk of `n` tokens moved off the first span of `whole` it would cut: its end back to the span's
    start, or on to the span's end where the span begins the chunk."""
    for start, end in whole:
        if start < n < end:
            return start if start > 0 else end
    return n


@dataclass(frozen=True)
class Fit:
    admit: bool  # fits now (after evicting `evict_bytes` from the prefix cache)
    evict_bytes: int = 0
    never: bool = False  # could not fit even with nothing else held


def fit_admission(need: int, held: int, cache_bytes: int, budget: int) -> Fit:
    """Whether `need` more bytes fit a `budget` of which `held` (cache included) is taken.

    The prefix cache gives way first: it is evicted only as far as needed.
    """
    if need > budget:
        return Fit(admit=False, never=True)
    free = budget - held
    if need <= free:
        return Fit(admit=True)
    if need <= free + cache_bytes:
        return Fit(admit=True, evict_bytes=need - free)
    return Fit(admit=False)


def clamp_max_tokens(asked: int | None, default: int | None, prompt_len: int, max_context: int) -> int:
    """max_tokens as asked (or the operator's default, or else the context left), never past the
    context left after the prompt."""
    left = max_context - prompt_len
    return max(0, min(asked or default or left, left))
