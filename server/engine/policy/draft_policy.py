"""When a decode row drafts: the batch-level policy of speculative decoding. Pure arithmetic.

A row that carries k drafted tokens makes its step's pass read k more positions. While the pass is
bound by reading the weights (one request, a few) those positions are nearly free; as the batch
grows the pass fills and each costs more of the step, until drafts that are mostly rejected make
the batch slower than without them. Whether a draft pays depends on both: how often the request's
drafts are accepted, and what a drafted position costs at this batch size.

The rule. A step decoding b rows takes T0 seconds without drafts, and each drafted token adds c
seconds. If row i drafts d_i tokens and is expected to accept a share p_i of them, the step commits
b + sum(p_i d_i) tokens in T0 + c sum(d_i) seconds, which beats b tokens in T0 exactly when
sum((p_i - b c / T0) d_i) > 0. So each row's drafts pay on their own when

    p_i > b * c / T0          (the break-even acceptance at batch size b: `break_even`)

and a row below it skips drafting in that step (other rows still draft). The two sides:
- c / T0 per batch size (`StepCost`): a least-squares line through the steps that decoded b rows
  and prefilled nothing, seconds against the positions their drafts made the pass compute
  (`computed`), over exponentially weighted moments (the step budget's fit, rates.fit_line). Until
  `MIN_STEPS` such steps are seen, or where the line has no slope yet, the cost is unknown and only
  `FLOOR` applies: drafting is how the slope is learnt. Steps that all draft alike cannot fix a
  slope either: then every `PROBE_EVERY`-th step of that batch size drafts nothing (`baseline`),
  which gives the line its other end.
- p_i (`Acceptance`): the request's recent drafted and accepted tokens (each verified draft decays
  the older ones by `RECENT`), shrunk towards the recent acceptance of all requests by `PRIOR_TOKENS`
  tokens' weight. A new request starts from what the batch's text has been doing (prose after prose
  does not draft at four rows), and one with a record goes by its own (a code edit beside prose does).
  All requests' acceptance starts optimistic (PRIOR_TOKENS drafted tokens all accepted) and forgets
  that start as drafts are verified (by `PRIOR_RECENT` per draft).
- `FLOOR`: below this acceptance no batch size pays (a rejected position is never free: its
  share of the pass and the roll back cost time on every backend); it also stops a request whose drafts are
  all rejected without waiting for its own switch (drafts.Adaptation, after its warm-up).
- probing: a row that skipped drafting `PROBE_EVERY` steps in a row drafts once, so its acceptance
  follows its text: a request whose reply turns repetitive (a file restated after prose) turns
  drafting back on after a few accepted probes. A new request's first draft is such a probe, so its
  own record starts at once, whatever the requests before it did.

Padded passes (`Backend.pads_verify`: MLX, whose batch runs every row at the longest row's length).
There a step whose longest draft is L computes b L positions beyond its b, whatever the other rows
draft, so the cost line is fitted on those positions (`computed`) and a row's draft costs what it adds
to the longest, not its own length: once one row pays for L, the others' drafts up to L are free. The
step's drafts are chosen together (`common_length`): every row whose drafts clear `FLOOR` proposes
its draft, and all are trimmed to the one length L that gives the most tokens per second,

    (b + sum(p_i min(d_i, L))) / (T0 + c b L)       over L in {0} and the drafts' lengths,

so a step drafts only when enough of its rows' drafts pay, and a long draft that few rows could use
is cut to what the batch can afford. A probing row still drafts, at most `PROBE_TOKENS` when nothing
else pays: its probe costs every row of the pass those positions. With ragged passes (torch) this is
the rule above: each row by its own break-even, at its full length.

A step that prefills drafts nothing (Speculation.draft_all): its pass is compute-bound by the prompt
chunks, so a drafted position there costs what a prompt token costs, comes out of the step's token
budget, and lengthens the step that every prefilling request waits on. The requests it delays are
not in the rule above, and they decide a batch's end: on the agent workload at four requests (a
chain of followers, each waiting for its leader's prefill) drafting during prefill made suffix
0.86-0.94x of off; without it, 1.2x (docs/benchmarks.md).

Drafting or not never changes a token: verification keeps only what the request's sampler draws.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from kvfork.server.engine.policy.rates import fit_line

MIN_STEPS = 8  # steps of a batch size seen before its cost is trusted
COST_WEIGHT = 0.05  # weight of each step in its batch size's moments (the last ~20-40 steps count)
RECENT = 0.8  # a request's older drafts decay by this per verified draft
PRIOR_RECENT = 0.9  # all requests' older drafts decay by this per verified draft
PRIOR_TOKENS = 4.0  # how many drafted tokens' weight the prior has in a request's estimate
FLOOR = 0.1  # acceptance below which drafting never pays
PROBE_EVERY = 8  # a row that skipped this many steps in a row drafts once
PROBE_TOKENS = 4  # most tokens a probe drafts where it alone pads a pass (Backend.pads_verify)


@dataclass(frozen=True)
class Acceptance:
    """Drafted and accepted tokens, older drafts decayed by `decay` per draft."""

    drafted: float = 0.0
    accepted: float = 0.0
    decay: float = RECENT

    def after(self, drafted: int, accepted: int) -> Acceptance:
        return replace(self, drafted=self.decay * self.drafted + drafted,
                       accepted=self.decay * self.accepted + accepted)

    def share(self, prior: float = 1.0, weight: float = 0.0) -> float:
        """Accepted per drafted token, shrunk towards `prior` by `weight` tokens (`prior` when none)."""
        total = self.drafted + weight
        return (self.accepted + weight * prior) / total if total > 0 else prior


@dataclass(frozen=True)
class StepCost:
    """Seconds of the steps that decoded one batch size against the positions their drafts made the pass
    compute (`computed`): EMA moments of (1, x, y, x*x, x*y), x those positions and y the seconds, and
    how many steps were seen."""

    moments: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    steps: int = 0

    def observe(self, drafted: int, seconds: float) -> StepCost:
        sample = (1.0, drafted, seconds, drafted * drafted, drafted * seconds)
        if self.steps == 0:
            return StepCost(sample, 1)  # type: ignore[arg-type]
        moments = tuple(old + COST_WEIGHT * (new - old) for old, new in zip(self.moments, sample))
        return StepCost(moments, self.steps + 1)  # type: ignore[arg-type]

    def ratio(self) -> float | None:
        """c / T0: what a computed position adds to the step, as a share of the step without drafts;
        None while unknown (too few steps, or drafted counts that cannot fix a slope)."""
        fit = fit_line(self.moments) if self.steps >= MIN_STEPS else None
        if fit is None:
            return None
        fixed, slope = fit
        if slope <= 0:
            return 0.0
        return slope / fixed if fixed > 0 else float("inf")


def break_even(batch: int, ratio: float | None) -> float:
    """The acceptance a row's drafts need to pay in a step of `batch` decode rows."""
    return FLOOR if ratio is None else max(FLOOR, batch * ratio)


def draft_pays(expected: float, batch: int, ratio: float | None, skipped: int) -> bool:
    """Whether a row expected to accept this share of its drafts drafts in this step, having
    skipped the last `skipped` steps."""
    return expected > break_even(batch, ratio) or skipped >= PROBE_EVERY


def computed(drafted: Sequence[int], padded: bool) -> int:
    """Positions a verify pass computes beyond one per row, its rows carrying `drafted` tokens: their sum
    when the pass is ragged, the longest for every row when it pads to the longest row."""
    return len(drafted) * max(drafted, default=0) if padded else sum(drafted)


def common_length(expected: Sequence[float], drafted: Sequence[int], probing: Sequence[bool],
                  batch: int, ratio: float | None) -> int:
    """The length every draft of a padded pass is trimmed to: the one of most expected tokens per second,
    rows drafting `drafted` tokens each accepted at `expected`, `ratio` what a computed position adds
    to a step of `batch` rows; at least `PROBE_TOKENS` (or a shorter probe's own length) where a row
    probes. The shorter length on a tie."""
    least = max((min(d, PROBE_TOKENS) for d, probe in zip(drafted, probing) if probe), default=0)
    if ratio == float("inf"):
        return least
    cost = batch * (ratio or 0.0)

    def rate(length: int) -> float:
        return (batch + sum(p * min(d, length) for p, d in zip(expected, drafted))) / (1 + cost * length)

    return max({least, *(d for d in drafted if d > least)}, key=lambda length: (rate(length), -length))


class DraftPolicy:
    """The runner's view (one per runner thread): each batch size's step cost and all requests'
    recent acceptance. A request's own acceptance and skipped steps live on its Seq."""

    def __init__(self) -> None:
        self.costs: dict[int, StepCost] = {}
        # it starts as if PRIOR_TOKENS drafted tokens had all been accepted, forgotten as drafts are verified
        self.prior = Acceptance(PRIOR_TOKENS, PRIOR_TOKENS, PRIOR_RECENT)

    def step(self, batch: int, positions: int, seconds: float) -> None:
        """A step that decoded `batch` rows, computing `positions` beyond one a row (`computed`), and prefilled
        nothing."""
        if batch > 0 and seconds > 0:
            self.costs[batch] = self.costs.get(batch, StepCost()).observe(positions, seconds)

    def baseline(self, batch: int) -> bool:
        """Whether no row drafts in this step of `batch` rows: one without drafts, for a cost that has none to compare."""
        cost = self.costs.get(batch)
        return (cost is not None and cost.steps >= MIN_STEPS and cost.steps % PROBE_EVERY == 0
                and cost.ratio() is None)

    def verified(self, drafted: int, accepted: int) -> None:
        self.prior = self.prior.after(drafted, accepted)

    def expected(self, own: Acceptance) -> float:
        """A row's expected acceptance: its own record, shrunk towards all requests'."""
        return own.share(self.prior.share(), PRIOR_TOKENS)

    def ratio(self, batch: int) -> float | None:
        cost = self.costs.get(batch)
        return cost.ratio() if cost is not None else None

    def allows(self, own: Acceptance, batch: int, skipped: int, padded: bool = False) -> bool:
        """Whether a row with this acceptance of its own drafts in a step of `batch` decode rows; in a
        padded pass, whether it proposes a draft for `common_length` to trim (it clears the floor)."""
        return draft_pays(self.expected(own), batch, None if padded else self.ratio(batch), skipped)

    def padded_length(self, rows: Sequence[tuple[Acceptance, int, bool]], batch: int) -> int:
        """`common_length` of a padded step's proposed drafts: (acceptance, tokens drafted, probing) each."""
        return common_length([self.expected(own) for own, _, _ in rows], [d for _, d, _ in rows],
                             [probe for _, _, probe in rows], batch, self.ratio(batch))
