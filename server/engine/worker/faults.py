"""Faults stay where they start: a forward pass or a sampling call that fails, recovered from
row by row, so a failure is charged to the request it belongs to and nothing committed is
computed twice (base.BatchFailed is the backends' half of this contract).

    forward(run, rows, fail) -> [(group, logits)]    run(rows) -> logits; fail(rid, error)
    sample(draw, rids, fail) -> [(rid, Sampled)]     draw(rids) -> picks, one per row

Rules:
- a forward pass that fails says per session what it did: UNTOUCHED rows run again
  without the others (one by one when nothing else changed, and alone twice, so only a
  failure that stays is charged to its own request); COMMITTED ones go on with their
  logits row; CORRUPT ones, and COMMITTED ones that need logits the backend could not
  give, fail with an error and are never read again;
- a ValueError is check_inputs' refusal, before any state changed: the rows run one by
  one to find the culprit; any other exception is a backend bug, and every row of that
  call fails;
- sampling that fails after a forward pass samples again row by row (the backend's
  sampler changes nothing when it raises); the forward pass is never run again, and a
  row whose sampling fails alone, twice, fails alone.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from kvfork.backends.base import BatchFailed, RowState, Sampled
from kvfork.server.engine.worker.plan import Row

log = logging.getLogger("kvfork.engine")

Fail = Callable[[int, str], None]
Group = tuple[list[Row | None], Any]  # rows whose tokens are committed (None: a row nobody reads), their logits


def forward(run: Callable[[list[Row]], Any], rows: list[Row], fail: Fail, retried: bool = False) -> list[Group]:
    """Run one batched forward pass, failing exactly the requests whose state can no longer be
    trusted. Row i of a group's logits belongs to group[i]; logits is None when no row of its
    group needs them. `retried`: this call already failed once alone, changing nothing."""
    try:
        return [(list(rows), run(rows))]
    except BatchFailed as failed:
        if len(failed.rows) != len(rows):
            for row in rows:
                fail(row.rid, f"backend failure ({failed}), with {len(failed.rows)} row states for {len(rows)} "
                              f"sessions")
            return []
        return _salvage(run, rows, failed, fail, retried)
    except ValueError as exc:  # check_inputs refused the call before it changed anything
        if len(rows) == 1:
            fail(rows[0].rid, f"refused by the backend: {exc}")
            return []
        return _one_by_one(run, rows, fail)
    except Exception as exc:
        for row in rows:
            fail(row.rid, f"backend failure, state lost: {exc!r}")
        return []


def _salvage(run: Callable[[list[Row]], Any], rows: list[Row], failed: BatchFailed, fail: Fail,
             retried: bool) -> list[Group]:
    groups: list[Group] = []
    kept: list[Row | None] = []
    retry = []
    for i, (row, state) in enumerate(zip(rows, failed.rows)):
        kept.append(None)
        if state is RowState.UNTOUCHED:
            retry.append(i)
        elif state is RowState.COMMITTED and (failed.logits is not None or not row.logits):
            kept[i] = row
        elif state is RowState.COMMITTED:
            fail(row.rid, f"a backend failure ({failed}) left its tokens committed without their logits")
        else:
            fail(row.rid, f"a backend failure ({failed}) left its state partly written")
    if any(kept):
        groups.append((kept, failed.logits))
    if len(retry) < len(rows):
        if retry:
            groups += forward(run, [rows[i] for i in retry], fail)
    elif len(rows) == 1 and retried:  # it failed alone twice and changed nothing: its own failure
        fail(rows[0].rid, f"backend failure: {failed}")
    elif len(rows) == 1:  # alone, nothing changed: once more, so a passing fault is charged to no one
        groups += forward(run, rows, fail, retried=True)
    else:  # nothing changed anywhere: row by row, so a failure that stays is charged to its own request
        groups += _one_by_one(run, rows, fail)
    return groups


def _one_by_one(run: Callable[[list[Row]], Any], rows: list[Row], fail: Fail) -> list[Group]:
    return [group for row in rows for group in forward(run, [row], fail)]


def sample(draw: Callable[[Sequence[int]], list[Sampled]], rids: list[int], fail: Fail,
           retried: bool = False) -> list[tuple[int, Sampled]]:
    """Sample the rows of `rids` (draw samples those rows alone, one pick each). `retried`: this one
    row's sampling already failed once alone."""
    try:
        picks = draw(rids)
    except Exception as exc:
        if len(rids) == 1 and retried:
            fail(rids[0], f"sampling failed: {exc}")
            return []
        if len(rids) == 1:  # the sampler changed nothing: once more before charging the request
            return sample(draw, rids, fail, retried=True)
        log.warning("sampling a batch failed (%s); sampling its rows one by one", exc)
        return [pick for rid in rids for pick in sample(draw, [rid], fail)]
    return list(zip(rids, picks))
