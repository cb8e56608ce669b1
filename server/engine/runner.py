"""The runner: the one thread that owns the backend.

Each step it takes what the control loop sent (starts, cancellations, clones,
releases), asks the scheduler what to run, runs it, and publishes the results,
with every running request's committed position, on the event deque; then it
wakes the loop with `call_soon_threadsafe`. It never waits on the loop.

Design rules:
- a capture (a clone at prompt length) takes the request's recurrent checkpoints
  with it (they serve the same prefixes from the cache, which counts their
  bytes from then on). It runs right after the last prefill chunk
  and before the first decode writes: a decode would overwrite what a sliding
  layer's snapshot needs. On a model with recurrent layers it runs one token
  before the prompt's end (prefill stops there; base.py's recurrent rule), so
  the same prompt sent again, whose match is at most len - 1, is served;
- a follower's clone order is served the moment its donor has committed the
  target (the donor's chunk stops there), before the donor writes again;
- a donor that leaves hands what it committed to the follower that salvages
  most (follow.promote), cloned before its state is released;
- a donor with recurrent layers holds a state only at its position and its
  checkpoints (base.py's recurrent rule): a clone asked of it where it holds
  none (it moved on since the loop looked, or it leaves below a follower's
  target) is served from the highest state it holds below, if any;
- every CloneDonor is answered by exactly one CloneDone (a session, a refusal,
  or "cancelled" for an order dropped while it waited): the control loop holds
  the clone's bytes until then;
- faults stay where they start, and nothing committed is computed twice
  (base.BatchFailed is the backends' half of this contract):
  - a forward pass that fails says per session what it did: UNTOUCHED sessions
    run again without the others (one by one when nothing else changed, and
    alone twice, so only a failure that stays is charged to its own request);
    COMMITTED ones go on
    with their logits row; CORRUPT ones, and COMMITTED ones that need logits
    the backend could not give, fail with an error and are never read again;
  - a ValueError is check_inputs' refusal, before any state changed: the rows
    run one by one to find the culprit; any other exception is a backend bug,
    and every session of that call fails;
  - sampling that fails after a forward pass samples again row by row (the
    backend's sampler changes nothing when it raises); the forward pass is
    never run again, and a row whose sampling fails alone, twice, fails alone;
- optional work (a snapshot, a clone from the prefix cache) that fails for
  any reason falls back, to the next candidate or to none, and is counted;
- grammar-constrained rows (constraints.py) join their mask just before a sample
  and hand the sampled token over just after it; nothing else here knows them;
- n choices prefill their prompt once: when its last logits row is in (after
  the capture, before any decode writes), each other choice gets a clone of the
  session at the prompt's full length and samples its first token from that
  row with its own stream (and its own matcher, at the grammar's start); a
  clone or a sample that fails fails its choice alone.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from backends.base import (Backend, BatchFailed, CloneRefused, ModelInfo, RowState, Sampled, SamplerState,
                           SamplingParams, Session, clone_positions)
from server.engine import messages as m
from server.engine.clone_orders import CloneOrders
from server.engine.constraints import ConstrainedRows
from server.engine.rates import RateTracker, split_pass
from server.engine.scheduler import Running, TimeBudget, plan_step

log = logging.getLogger("kvfork.engine")
_DISCARD = SamplingParams()  # greedy: samples the logits rows nobody reads, leaving real streams untouched


@dataclass
class _Slot:
    """A request in an inference slot, as the runner sees it."""

    start: m.Start
    session: Session
    sampler: SamplerState
    prefilled: int = 0
    generated: int = 0
    next_token: int | None = None  # sampled, not yet committed
    choices: list[m.Choice] = field(default_factory=list)  # opened when the prompt's last logits are in
    capture_at: int = 0  # where its prompt is snapshot (Start.capture), 0: nowhere

    @property
    def prefill_left(self) -> int:
        return max(0, len(self.start.prompt) - self.session.position)

    def prefill_cap(self, orders: int | None) -> int | None:
        """Most tokens it may prefill this step: up to a follower's target (`orders`), and up to its capture."""
        position = self.session.position
        if position < self.capture_at < len(self.start.prompt):
            return min(self.capture_at - position, orders or self.prefill_left)
        return orders


class Runner:
    def __init__(self, backend: Backend, model_path: str, dtype: str | None,
                 max_batch_tokens: int, prefill_chunk: int, max_step_s: float, notify: Callable[[], None],
                 clone_mode: str = "share"):
        self.backend, self.model_path, self.dtype, self.clone_mode = backend, model_path, dtype, clone_mode
        self.max_batch_tokens, self.prefill_chunk, self.max_step_s = max_batch_tokens, prefill_chunk, max_step_s
        # The step budget's own rates, from the step timings measured here (the
        # control loop keeps the cost model's, from the same StepStats).
        self._rates = RateTracker()
        self.inbox: collections.deque = collections.deque()  # control loop -> runner
        self.events: collections.deque = collections.deque()  # runner -> control loop
        self._notify = notify
        self._wake = threading.Event()
        self._slots: dict[int, _Slot] = {}
        self._orders = CloneOrders()
        self._rotation: int | None = None
        self._stopping = False
        self._backend_s = 0.0
        self._constrained: ConstrainedRows | None = None  # once the model is loaded (it knows the vocabulary)
        self._info: ModelInfo | None = None  # once loaded
        self._recurrent = False  # the model has recurrent layers
        self._releases = 0  # Release commands run (m.Pooled)
        self.thread = threading.Thread(target=self._main, name="kvfork-runner", daemon=True)

    def send(self, command: Any) -> None:
        self.inbox.append(command)
        self._wake.set()

    # ---- thread body ----

    def _main(self) -> None:
        try:
            self.backend.set_clone_mode(self.clone_mode)  # type: ignore[arg-type]
            info = self._info = self.backend.load(self.model_path, self.dtype)
            self._recurrent = any(layer.kind == "recurrent" for layer in info.layers)
            self._constrained = ConstrainedRows(info.vocab_size)
            self._publish(m.Loaded(info))
        except Exception as exc:
            log.exception("model load failed")
            self._publish(m.Died(f"model load failed: {exc}"))
            return
        try:
            while not self._stopping:
                self._wake.clear()
                self._take_commands()
                if self._slots:
                    self._step()
                elif not self._stopping:
                    self._wake.wait()
        except BaseException as exc:  # the thread is dying: say so, never leave the loop waiting
            log.exception("runner died")
            self._publish(m.Died(f"runner died: {exc!r}"))

    @property
    def _rows(self) -> ConstrainedRows:
        assert self._constrained is not None, "no request runs before the model is loaded"
        return self._constrained

    def _publish(self, *events: Any) -> None:
        self.events.extend(events)
        self._notify()

    def _timed(self, fn: Callable, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._backend_s += time.perf_counter() - t0

    # ---- commands ----

    def _take_commands(self) -> None:
        took = bool(self.inbox)
        while self.inbox:
            command = self.inbox.popleft()
            if isinstance(command, m.Start):
                self._start(command)
            elif isinstance(command, (m.Cancel, m.Finish)):
                if self._orders.drop_recipient(command.rid):  # every order is answered, a dropped one too
                    self.events.append(m.CloneDone(command.rid, None, reason="cancelled"))
                reason = "cancelled" if isinstance(command, m.Cancel) else "stop"
                slot = self._slots.get(command.rid)
                if slot is not None:
                    self._end(slot, reason)
                else:
                    self._drop_choice(command.rid, reason)
            elif isinstance(command, m.CloneDonor):
                self._clone_donor(command)
            elif isinstance(command, m.Release):
                for session in command.sessions:
                    self.backend.release(session)
                self._releases += 1
            elif isinstance(command, m.Spill):
                self._spill(command)
            elif isinstance(command, m.Restore):
                self._restore(command)
            elif isinstance(command, m.Stop):
                self._orders = CloneOrders()  # nobody is left to hand anything over to
                for slot in list(self._slots.values()):
                    self._end(slot, "cancelled")
                self._rows.close()
                self._stopping = True
        self._serve_orders()
        if took and not self._slots:
            self.events.append(m.Holding(self.backend.live_sessions(), self.backend.total_bytes(), self._pooled(),
                                         self.backend.block_stats()))
        if self.events:
            self._notify()

    def _start(self, start: m.Start) -> None:
        session, reused, index, refused, clone_s = start.resume, start.resume_at, None, [], 0.0
        if start.donor is not None:
            t0 = time.perf_counter()
            session, reused, reason = self._clone_of(*start.donor)
            if session is None:
                self.events.append(m.CloneDone(start.rid, None, reason=reason))
                return
            clone_s = time.perf_counter() - t0
        try:
            for i, (source, upto) in enumerate(start.clone_from if session is None else ()):
                try:
                    t0 = time.perf_counter()
                    session, reused, index = self._timed(self.backend.clone, source, upto), upto, i
                    clone_s = time.perf_counter() - t0
                    break
                except CloneRefused as refusal:
                    refused.append(refusal.reason)
                except Exception as exc:  # optional work: the next candidate, or a cold start
                    log.warning("clone from the prefix cache for request %d failed: %r", start.rid, exc)
                    refused.append("error")
            if session is None:
                session, reused = self.backend.open_session(), 0
            if start.keep_at:
                self._keep_at(session, start.keep_at)
        except Exception as exc:
            log.exception("start failed")
            self.events.append(m.Started(start.rid, 0, None, refused))
            for rid in [start.rid] + [choice.rid for choice in start.choices]:
                self.events.append(m.Finished(rid, "error", 0, 0, error=f"start failed: {exc}"))
            return
        sampler = SamplerState(start.sampling, prompt=start.prompt)
        capture_at = len(start.prompt) - 1 if self._recurrent else len(start.prompt)
        self._slots[start.rid] = _Slot(start, session, sampler, choices=list(start.choices),
                                       capture_at=capture_at if start.capture else 0)
        self._rows.start(start.rid, start.constraint)
        self.events.append(m.Started(start.rid, reused, index, refused, clone_s))

    def _spill(self, command: m.Spill) -> None:
        """Optional work: a state that fails to export is simply not kept on disk."""
        state = None
        try:
            state = self._timed(self.backend.export_state, command.session)
        except Exception as exc:
            log.warning("exporting a prefix cache entry failed: %r", exc)
        self.backend.release(command.session)
        self.events.append(m.Exported(command.key, state))

    def _restore(self, command: m.Restore) -> None:
        """Optional work: a state that fails to load leaves its request to prefill."""
        t0 = time.perf_counter()
        try:
            session = self._timed(self.backend.import_state, command.state)
        except Exception as exc:
            log.warning("loading a saved state for request %d failed: %r", command.rid, exc)
            self.events.append(m.Restored(command.rid, None))
            return
        self.events.append(m.Restored(command.rid, session, session.position, time.perf_counter() - t0))

    def _keep_at(self, session: Session, positions: tuple[int, ...]) -> None:
        """Checkpoints at message boundaries are optional work: a backend that fails them runs on without."""
        try:
            self._timed(self.backend.keep_at, session, positions)
        except Exception as exc:
            log.warning("keeping checkpoints at %s failed: %r", positions, exc)

    def _clone_donor(self, command: m.CloneDonor) -> None:
        donor = self._slots.get(command.donor)
        if donor is None:
            self.events.append(m.CloneDone(command.rid, None, reason="donor_gone"))
        elif donor.session.position < command.upto:
            self._orders.add(command)
        else:
            self._clone_for(command.rid, donor, command.upto)

    def _clone_of(self, donor_rid: int, upto: int) -> tuple[Session, int, None] | tuple[None, int, str]:
        """`[0, upto)` of a running request's session (at most: a recurrent donor gives the highest
        state it holds at or below), with what it holds, or why not (a clone fails soft)."""
        donor = self._slots.get(donor_rid)
        if donor is None:
            return None, 0, "donor_gone"
        if self._recurrent:
            assert self._info is not None
            held = clone_positions(donor.session.position, self._info, donor.session.kept)
            upto = max((p for p in held if p <= upto), default=upto)  # none below: the clone is refused
        try:
            return self._timed(self.backend.clone, donor.session, upto), upto, None
        except CloneRefused as refusal:
            return None, 0, refusal.reason
        except Exception as exc:
            log.warning("clone of request %d failed: %s", donor_rid, exc)
            return None, 0, "error"

    def _clone_for(self, rid: int, donor: _Slot, upto: int, refused_reason: str | None = None) -> None:
        t0 = time.perf_counter()
        session, upto, reason = self._clone_of(donor.start.rid, upto)
        if session is not None:
            self.events.append(m.CloneDone(rid, session, upto, seconds=time.perf_counter() - t0))
        else:
            self.events.append(m.CloneDone(rid, None, reason=refused_reason or reason))

    def _serve_orders(self) -> None:
        for order in self._orders.due({rid: slot.session.position for rid, slot in self._slots.items()}):
            self._clone_for(order.rid, self._slots[order.donor], order.upto)

    def _hand_over(self, slot: _Slot, usable: bool) -> None:
        """A donor with followers waiting is leaving: its heir gets what it committed, the rest plan again."""
        committed = min(slot.session.position, len(slot.start.prompt))
        heir, upto, others = self._orders.leaving(slot.start.rid, committed, usable)
        if heir is not None:
            self._clone_for(heir.rid, slot, upto, refused_reason="leader_gone")
        for order in others:
            self.events.append(m.CloneDone(order.rid, None, reason="leader_gone"))

    # ---- one step ----

    def _step(self) -> None:
        t0, self._backend_s = time.perf_counter(), 0.0
        running = [Running(rid, s.prefill_left, s.prefill_cap(self._orders.prefill_cap(rid, s.session.position,
                                                                                       s.prefill_left)))
                   for rid, s in self._slots.items()]
        rates = self._rates.rates
        budget = TimeBudget(self.max_step_s, rates.decode_s, rates.step_s_per_token) if self.max_step_s else None
        plan = plan_step(running, self.max_batch_tokens, self.prefill_chunk, self._rotation, budget)
        self._rotation = plan.last_prefilled
        decoding = [self._slots[rid] for rid in plan.decode]
        prefilling = [self._slots[rid] for rid, _ in plan.prefill]
        prefill_s = 0.0
        tokens = sum(n for _, n in plan.prefill)
        if not self.backend.mixed_batches and decoding:
            self._run(decoding, [], {})  # then the prefill chunks in a pass of their own
            if prefilling:
                before = self._backend_s
                self._run([], prefilling, dict(plan.prefill))
                prefill_s = self._backend_s - before
        elif decoding or prefilling:
            self._run(decoding, prefilling, dict(plan.prefill))
            prefill_s = split_pass(len(decoding), tokens, self._backend_s)[1]
        if decoding:  # the step budget's rates: the whole step against its prefill tokens
            self._rates = self._rates.observe_step(tokens, self._backend_s)
        self._rates = self._rates.observe_prefill(tokens, prefill_s)
        self._serve_orders()
        committed = {rid: s.session.position for rid, s in self._slots.items()}
        kept = {rid: s.session.kept for rid, s in self._slots.items() if s.session.kept}
        live, nbytes = self._timed(self.backend.live_sessions), self._timed(self.backend.total_bytes)
        pooled, blocks = self._timed(self._pooled), self._timed(self.backend.block_stats)
        self._publish(m.StepStats(committed, live, nbytes, time.perf_counter() - t0, self._backend_s,
                                  sum(n for _, n in plan.prefill), prefill_s, kept, pooled, blocks))

    def _pooled(self) -> m.Pooled:
        return m.Pooled(self.backend.pooled_bytes(), self._releases)

    def _run(self, decoding: list[_Slot], prefilling: list[_Slot], chunks: dict[int, int]) -> None:
        """One forward pass: the decoding requests' next tokens and the prefilling ones' chunks
        (both kinds only on a `mixed_batches` backend: one `prefill` call takes rows of any length)."""
        pieces = {}
        for s in prefilling:
            at = s.session.position
            pieces[s.start.rid] = s.start.prompt[at:at + chunks[s.start.rid]]
        rows = [[s.next_token] for s in decoding] + [pieces[s.start.rid] for s in prefilling]
        # Rows that need their logits: every decode row, and the chunks that end their prompt.
        last = [True] * len(decoding) + [s.prefill_left == len(pieces[s.start.rid]) for s in prefilling]
        call = self.backend.prefill if prefilling else self._decode_call
        for group, logits in self._forward(call, decoding + prefilling, rows, last):
            for slot in group:
                if slot is not None:
                    slot.prefilled += len(pieces.get(slot.start.rid, ()))
            for slot in group:
                if slot is not None and slot.start.rid in pieces and slot.session.position == slot.capture_at:
                    self._capture(slot)
            ready = [s if s is not None and s.prefill_left == 0 else None for s in group]
            for row, slot in enumerate(ready):
                if slot is not None and slot.choices:  # its prompt is in: its other choices start here
                    self._open_choices(slot, logits, row, len(ready))
            if any(ready):
                self._sample(logits, ready)

    def _decode_call(self, sessions: list[Session], rows: list[list[int]]) -> Any:
        return self.backend.decode(sessions, [row[0] for row in rows])

    def _forward(self, call: Callable[[list[Session], list], Any], slots: list[_Slot], rows: list,
                 needs_logits: list[bool], retried: bool = False) -> list[tuple[list[_Slot | None], Any]]:
        """Run one batched forward pass, failing exactly the requests whose state can no longer be
        trusted. Returns (group, logits) pairs: row i of logits belongs to group[i], a request
        whose tokens are committed, or None (a row nobody reads); logits is None when no row of
        its group needs them. `retried`: this call already failed once alone, changing nothing."""
        try:
            return [(list(slots), self._timed(call, [s.session for s in slots], rows))]
        except BatchFailed as failed:
            if len(failed.rows) != len(slots):
                self._fail_all(slots, f"backend failure ({failed}), with {len(failed.rows)} row states for "
                                      f"{len(slots)} sessions")
                return []
            return self._salvage(call, slots, rows, needs_logits, failed, retried)
        except ValueError as exc:  # check_inputs refused the call before it changed anything
            if len(slots) == 1:
                self._fail(slots[0], f"refused by the backend: {exc}")
                return []
            return self._one_by_one(call, slots, rows, needs_logits)
        except Exception as exc:
            self._fail_all(slots, f"backend failure, state lost: {exc!r}")
            return []

    def _salvage(self, call: Callable, slots: list[_Slot], rows: list, needs_logits: list[bool],
                 failed: BatchFailed, retried: bool) -> list[tuple[list[_Slot | None], Any]]:
        groups: list[tuple[list[_Slot | None], Any]] = []
        kept: list[_Slot | None] = []
        retry = []
        for i, (slot, state) in enumerate(zip(slots, failed.rows)):
            kept.append(None)
            if state is RowState.UNTOUCHED:
                retry.append(i)
            elif state is RowState.COMMITTED and (failed.logits is not None or not needs_logits[i]):
                kept[i] = slot
            elif state is RowState.COMMITTED:
                self._fail(slot, f"a backend failure ({failed}) left its tokens committed without their logits")
            else:
                self._fail(slot, f"a backend failure ({failed}) left its state partly written")
        if any(kept):
            groups.append((kept, failed.logits))
        if len(retry) < len(slots):
            if retry:
                groups += self._forward(call, [slots[i] for i in retry], [rows[i] for i in retry],
                                        [needs_logits[i] for i in retry])
        elif len(slots) == 1 and retried:  # it failed alone twice and changed nothing: its own failure
            self._fail(slots[0], f"backend failure: {failed}")
        elif len(slots) == 1:  # alone, nothing changed: once more, so a passing fault is charged to no one
            groups += self._forward(call, slots, rows, needs_logits, retried=True)
        else:  # nothing changed anywhere: row by row, so a failure that stays is charged to its own request
            groups += self._one_by_one(call, slots, rows, needs_logits)
        return groups

    def _one_by_one(self, call: Callable, slots: list[_Slot], rows: list,
                    needs_logits: list[bool]) -> list[tuple[list[_Slot | None], Any]]:
        return [group for i in range(len(slots))
                for group in self._forward(call, slots[i:i + 1], rows[i:i + 1], needs_logits[i:i + 1])]

    def _sample(self, logits: Any, group: list[_Slot | None], retried: bool = False) -> None:
        """Sample the rows of `group`'s requests (None rows are sampled greedily and dropped).
        `retried`: this one row's sampling already failed once alone."""
        states = [s.sampler if s is not None else SamplerState(_DISCARD) for s in group]
        states = self._rows.before_sample([s.start.rid if s is not None else None for s in group], states)
        try:
            picks = self._timed(self.backend.sample, logits, states)
        except Exception as exc:
            wanted = [i for i, s in enumerate(group) if s is not None]
            if len(wanted) == 1 and retried:
                self._fail(group[wanted[0]], f"sampling failed: {exc}")
                return
            if len(wanted) == 1:  # the sampler changed nothing: once more before charging the request
                self._sample(logits, group, retried=True)
                return
            log.warning("sampling a batch failed (%s); sampling its rows one by one", exc)
            for i in wanted:
                self._sample(logits, [s if j == i else None for j, s in enumerate(group)])
            return
        for slot, pick in zip(group, picks):
            if slot is not None:
                self._accept(slot, pick)

    def _open_choices(self, lead: _Slot, logits: Any, row: int, rows: int) -> None:
        """`lead`'s prompt is in and row `row` of `logits` is its last: every other choice starts from a
        clone at the prompt's full length (before `lead` decodes) and samples its first token from that row."""
        choices, lead.choices = lead.choices, []
        for choice in choices:
            start = replace(lead.start, rid=choice.rid, sampling=choice.sampling, capture=False, choices=[])
            try:
                session = self._timed(self.backend.clone, lead.session, len(start.prompt))
            except Exception as exc:  # the clone of one choice fails that choice alone
                log.warning("the clone for choice request %d failed: %r", choice.rid, exc)
                self.events.append(m.Finished(choice.rid, "error", 0, 0, error=f"its clone failed: {exc!r}"))
                continue
            slot = self._slots[choice.rid] = _Slot(start, session, SamplerState(choice.sampling, prompt=start.prompt))
            self._rows.start(choice.rid, start.constraint)  # its own matcher: no choice has sampled yet
            self.events.append(m.Started(choice.rid, len(start.prompt), None))
            self._sample(logits, [slot if i == row else None for i in range(rows)])

    def _drop_choice(self, rid: int, reason: str) -> None:
        """A choice still waiting for its prompt leaves alone."""
        for slot in self._slots.values():
            if any(choice.rid == rid for choice in slot.choices):
                slot.choices = [choice for choice in slot.choices if choice.rid != rid]
                self.events.append(m.Finished(rid, reason, 0, 0))
                return

    def _capture(self, slot: _Slot) -> None:
        prompt = slot.start.prompt[:slot.capture_at]
        try:
            snapshot = self._timed(self.backend.clone, slot.session, len(prompt))
        except CloneRefused as refusal:
            log.info("capture of request %d refused: %s", slot.start.rid, refusal)
            self.events.append(m.Captured(slot.start.rid, prompt, None))
            return
        except Exception as exc:  # optional work: the request goes on without a snapshot
            log.warning("capture of request %d failed: %r", slot.start.rid, exc)
            self.events.append(m.Captured(slot.start.rid, prompt, None, failed=True))
            return
        if slot.session.kept:  # its message-boundary checkpoints go with the snapshot, which serves them
            try:
                self._timed(self.backend.move_checkpoints, slot.session, snapshot)
            except Exception as exc:  # optional work: the snapshot serves its own length only
                log.warning("moving checkpoints of request %d to its snapshot failed: %r", slot.start.rid, exc)
        self.events.append(m.Captured(slot.start.rid, prompt, snapshot, self.backend.session_bytes(snapshot),
                                      kept=snapshot.kept))

    def _accept(self, slot: _Slot, pick: Sampled) -> None:
        failure = self._rows.after_sample(slot.start.rid, pick.token)
        if failure is not None:
            self._end(slot, "error", error=failure)
            return
        slot.generated += 1  # the backend's sampler has appended the token to `sampler.output`
        if pick.token in slot.start.stop_ids:
            self._end(slot, "stop")
            return
        self.events.append(m.Token(slot.start.rid, pick))
        slot.next_token = pick.token
        if slot.generated >= slot.start.max_tokens:
            self._end(slot, "length")

    def _fail(self, slot: _Slot, error: str) -> None:
        log.warning("request %d failed: %s", slot.start.rid, error)
        self._end(slot, "error", error=error)

    def _fail_all(self, slots: list[_Slot], error: str) -> None:
        for slot in slots:
            self._fail(slot, error)

    def _end(self, slot: _Slot, reason: str, error: str | None = None) -> None:
        self._hand_over(slot, usable=reason != "error")
        for choice in slot.choices:  # it left before its prompt was in: its choices go with it
            self.events.append(m.Finished(choice.rid, reason, 0, 0, error))
        del self._slots[slot.start.rid]
        self._rows.end(slot.start.rid)
        kept, held, nbytes, frees = None, [], 0, 0
        if slot.start.keep_session and reason != "error":
            kept = slot.session
            if kept.kept or slot.start.keep_at:  # an idle named session is priced without checkpoints
                self._keep_at(kept, ())
            held = (slot.start.prompt + slot.sampler.output)[:slot.session.position]
            nbytes, frees = self.backend.session_bytes(kept), self.backend.release_frees(kept)
        else:
            self.backend.release(slot.session)
        self.events.append(m.Finished(slot.start.rid, reason, slot.prefilled, slot.generated, error, kept, held,
                                      nbytes, frees, self._pooled()))
