"""Speculative decoding on the runner: how it verifies a drafter's guesses, and how long a draft may be.

The drafters (server/engine/worker/drafts.py) guess tokens from text the request can see; the runner
verifies them inside its batched step (runner.py: a decode row carries its draft, the pass reads
every position's logits, `Speculation.walk` accepts the longest run the sampler agrees with, and the
session is rolled back past it: Backend.truncate).

Design rules:
- exactness: row j of a drafted row is sampled with the request's own sampler, as the next step
  would sample it, and draft token j is accepted when the draw equals it. For a greedy request
  that is "accept while the argmax equals the draft"; for a sampled one it is the rejection rule
  of a deterministic draft (accept t with probability p(t), else draw from p with t removed:
  a draw from p that is not t is exactly such a draw), and each token still takes one draw of
  its seeded stream, so a seeded request gives the same tokens with speculation on or off;
- the memory budget already holds every drafted position: a draft never reaches past the
  request's max_tokens, whose positions admission reserved (Admission.request_bytes);
- a drafter is optional work: one that raises is dropped for its request, which decodes on;
- nothing is drafted where it cannot be verified or rolled back: a backend or model that
  cannot roll back (`Backend.rolls_back`), a grammar whose matcher cannot check a draft
  (constraints.ConstrainedRows.admissible), or a step with more decode rows than
  --speculative-max-batch (compute-bound: verifying costs as much as it saves);
- nothing is drafted in a step that prefills: its pass is compute-bound by the prompt chunks, and
  drafted positions would come out of their token budget and lengthen the step every prefilling
  request waits on (other requests' time to first token, and a chain of followers, would pay for
  this one's speed: draft_policy.py);
- a row drafts only where its drafts pay at the step's batch size: its expected acceptance above
  what a drafted token costs there (draft_policy.py, from the steps' measured seconds), with a
  probe now and then so it can turn drafting back on.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Sequence

from kvfork.backends import effects as e
from kvfork.backends.base import Backend, ModelInfo
from kvfork.backends.vision.keys import text_only
from kvfork.server.engine.policy.draft_policy import PROBE_EVERY, DraftPolicy, computed
from kvfork.server.engine.worker import plan as p
from kvfork.server.engine.worker.constraints import ConstrainedRows
from kvfork.server.engine.worker.drafts import Draft, Drafts
from kvfork.server.engine.worker.sequence import Seq

log = logging.getLogger("kvfork.engine")

# Most tokens one decode row drafts, whatever the drafter proposes: verifying k tokens costs one
# pass reading k + 1 positions, which stays near one token's cost while the pass is bound by
# reading the weights (docs/benchmarks.md).
MAX_DRAFT = 16


def draft_cap(windows: Sequence[int]) -> int:
    """Most drafted tokens a row may carry on a model with these sliding windows: a verify row of
    k + 1 tokens must not overwrite a ring entry its rolled-back state still reads (k + 1 <= W)."""
    return min([MAX_DRAFT, *(w - 1 for w in windows)])


class Speculation:
    """A part of `Runner` (runner.py) that owns the draft policy (draft_policy.py) and the model's draft cap, built
    once the model is loaded with what else it reads and writes: the backend, the model, the grammar rows, the
    drafters, the running requests (read), and the runner's `run` (a session op), `sample` and `fail`. Its surface:
    a starting request's drafter (`open_drafts`), the drafting before a step is planned (`draft_all`), the step's
    time (`timed`), the walk over the drafted rows after their first token is sampled (`walk`, `accepts`), the roll
    back past what was not accepted (`roll_back`), and a finished request's drafter (`close_drafts`)."""

    def __init__(self, backend: Backend, info: ModelInfo, rows: ConstrainedRows, drafts: Drafts | None,
                 speculative_max_batch: int, running: dict[int, Seq], run: Callable[[e.Op], Any],
                 sample: Callable[[Any, dict[int, Seq]], None], fail: Callable[[int, str], None]):
        """`drafts`: None, off; used while a step decodes at most `speculative_max_batch` rows. `running`: the
        runner's requests by id (read, never changed here)."""
        self.backend, self._info, self._rows, self._drafts = backend, info, rows, drafts
        self._speculative_max_batch, self._running = speculative_max_batch, running
        self._run, self.sample, self._fail = run, sample, fail
        self._policy = DraftPolicy()  # which rows draft in a step (draft_policy.py)
        self._draft_cap = self._draft_cap_for(info)  # most tokens a row drafts (0: it does not speculate)

    def open_drafts(self, s: Seq) -> None:
        """A starting request's drafter, where this model speculates."""
        start = s.start
        if self._draft_cap and self._drafts is not None:
            try:
                s.drafts = self._drafts.open(start.scope, text_only(start.prompt) if start.images else start.prompt)
            except Exception as exc:  # optional work: it decodes without
                log.warning("opening a drafter for request %d failed: %r", start.rid, exc)

    def _draft_cap_for(self, info: ModelInfo) -> int:
        """Most tokens a row drafts on this model; 0, said once, where the backend cannot roll it back."""
        if self._drafts is None:
            return 0
        if not self.backend.rolls_back:
            log.warning("speculative decoding off: %s cannot roll drafted tokens back on this model "
                        "(recurrent or sliding layers it cannot undo)", type(self.backend).__name__)
            return 0
        return draft_cap(info.sliding_windows)

    def draft_all(self, decoding: list[int]) -> int:
        """Each decoding request's draft for this step: none in a step over --speculative-max-batch rows or
        while a running request has prompt left to prefill, and none for a row whose drafts would not pay at
        this batch size (draft_policy.py). The tokens drafted."""
        batch = len(decoding)
        prefilling = any(s.prefill_left > 0 for s in self._running.values())
        on = 0 < batch <= self._speculative_max_batch and not prefilling and not self._policy.baseline(batch)
        padded, proposed = self.backend.pads_verify, []
        for rid in decoding:
            s = self._running[rid]
            s.draft = None
            if on and s.drafts is not None and s.drafts.active:
                pays = self._policy.allows(s.acceptance, batch, s.skipped, padded)
                s.draft = self._propose(s) if pays else None
                if s.draft is not None:
                    proposed.append((s, s.skipped))
                s.skipped = 0 if pays else s.skipped + 1
            s.draft_from = s.generated
        if padded and proposed:
            self._trim_drafts(proposed, batch)
        total = 0
        for rid in decoding:
            s = self._running[rid]
            if s.draft is not None:
                total += len(s.draft.tokens)
                counts = s.speculated.setdefault(s.draft.source, [0, 0])
                counts[0] += len(s.draft.tokens)
        return total

    def _trim_drafts(self, proposed: list[tuple[Seq, int]], batch: int) -> None:
        """A padded pass's drafts, (request, steps it had skipped) each: all trimmed to the length that pays for
        the batch (draft_policy.common_length); a row trimmed to none skipped this step."""
        rows = [(s.acceptance, len(s.draft.tokens), skipped >= PROBE_EVERY) for s, skipped in proposed if s.draft]
        length = self._policy.padded_length(rows, batch)
        for s, skipped in proposed:
            assert s.draft is not None
            s.draft = replace(s.draft, tokens=s.draft.tokens[:length]) if length else None
            s.skipped = 0 if length else skipped + 1

    def timed(self, plan: p.StepPlan, seconds: float) -> None:
        """A step that decoded and prefilled nothing, into its batch size's cost of a computed position."""
        if self._draft_cap and plan.decode and not plan.prefill:
            drafted = [row.reads - 1 for row in plan.decode]
            self._policy.step(len(plan.decode), computed(drafted, self.backend.pads_verify), seconds)

    def _propose(self, s: Seq) -> Draft | None:
        """Its drafter's guess, cut to what may be verified: within its max_tokens (whose positions its
        reservation holds), the model's cap, the vocabulary and its grammar. A drafter that raises is dropped."""
        limit = min(self._draft_cap, s.start.max_tokens - s.generated - 1)
        if limit < 1:
            return None
        assert s.drafts is not None and self._info is not None
        try:
            draft = s.drafts.propose(s.sampler.output, limit)
        except Exception as exc:  # optional work: it decodes on without
            log.warning("the drafter of request %d failed, it decodes without: %r", s.rid, exc)
            s.drafts = None
            return None
        if draft is None:
            return None
        tokens = list(draft.tokens[:limit])
        vocab = self._info.vocab_size
        tokens = tokens[:next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), len(tokens))]
        tokens = tokens[:self._rows.admissible(s.rid, tokens)]
        return replace(draft, tokens=tokens) if tokens else None  # type: ignore[type-var]

    def walk(self, logits: Any, walking: list[tuple[Seq, int, int]]) -> None:
        """The drafted rows after their first token (sampled with the rest): while the last draw equals
        the draft, the next row is sampled (speculation.py: greedy, or the rejection rule), and only
        those rows are (a position past a rejected draft is never sampled); then each is rolled back
        to what it accepted. `walking`: (request, its first logits row, its tokens generated before
        that row was sampled)."""
        accepted = {s.rid: 0 for s, _, _ in walking}
        j = 0
        while walking:
            going = []
            for s, at, before in walking:
                assert s.draft is not None
                took = s.generated == before + 1 and self.accepts(s, s.sampler.output[-1])
                accepted[s.rid] += took
                if took and s.rid in self._running:
                    going.append((s, at, s.generated))
                else:
                    self._verified(s, accepted[s.rid])
            walking, j = going, j + 1
            if walking:
                self.sample(logits, {at + j: s for s, at, _ in walking})

    @staticmethod
    def accepts(s: Seq, token: int) -> bool:
        """Whether `token`, its latest, is the drafted one its row's position guessed."""
        j = s.generated - s.draft_from - 1
        return s.draft is not None and j < len(s.draft.tokens) and token == s.draft.tokens[j]

    def _verified(self, s: Seq, accepted: int) -> None:
        assert s.draft is not None
        drafted = len(s.draft.tokens)
        s.acceptance = s.acceptance.after(drafted, accepted)
        self._policy.verified(drafted, accepted)
        if s.rid in self._running:
            if s.drafts is not None:
                s.drafts.verified(s.draft, accepted)
            self.roll_back(s)
        s.draft = None

    def roll_back(self, s: Seq) -> bool:
        """Its session back to the tokens it has committed, past any drafted ones it did not accept."""
        committed = len(s.start.prompt) + s.generated - 1
        if s.generated == 0 or s.session.position <= committed:
            return True
        try:
            self._run(e.Truncate(s.sid, committed))
        except Exception as exc:
            if s.rid in self._running:
                self._fail(s.rid, f"rolling drafted tokens back failed: {exc!r}")
            return False
        return True

    def close_drafts(self, s: Seq, reason: str) -> None:
        """A finished output joins its scope's corpus (optional work)."""
        drafts, s.drafts = s.drafts, None
        if drafts is not None and reason != "error":
            try:
                drafts.close(s.sampler.output)
            except Exception as exc:
                log.warning("closing the drafter of request %d failed: %r", s.rid, exc)
