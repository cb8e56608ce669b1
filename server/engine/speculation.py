"""Speculative decoding on the runner: how it verifies a drafter's guesses, and how long a draft may be.

The drafters (server/engine/drafts.py) guess tokens from text the request can see; the runner
verifies them inside its batched step (runner.py: a decode row carries its draft, the pass reads
every position's logits, `Runner._walk` accepts the longest run the sampler agrees with, and the
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
  --speculative-max-batch (compute-bound: verifying costs as much as it saves).
"""

from __future__ import annotations

from typing import Sequence

# Most tokens one decode row drafts, whatever the drafter proposes: verifying k tokens costs one
# pass reading k + 1 positions, which stays near one token's cost while the pass is bound by
# reading the weights (docs/benchmarks.md).
MAX_DRAFT = 16


def draft_cap(windows: Sequence[int]) -> int:
    """Most drafted tokens a row may carry on a model with these sliding windows: a verify row of
    k + 1 tokens must not overwrite a ring entry its rolled-back state still reads (k + 1 <= W)."""
    return min([MAX_DRAFT, *(w - 1 for w in windows)])
