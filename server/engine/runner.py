"""The runner: the one thread that owns the backend. Each step (`Runner.step`):

    take commands  the control loop's starts, ends, clone orders, releases, spills, state loads
    plan           the scheduler's decode rows and prefill chunks, as a StepPlan (plan.py)
    forward        the plan's pass(es), failures recovered row by row (faults.py)
    commit         each row's progress, captures and choices; then its token, sampled (`sample`)
                   and, for a drafted row, walked over its draft (speculation.py)
    publish        tokens, ends, every running request's committed position: events for the loop

It never waits on the loop: events go on a deque, and `notify` wakes the loop
(`call_soon_threadsafe`).

Design rules:
- a capture (a clone at prompt length) takes the request's recurrent checkpoints
  with it (they serve the same prefixes from the cache, which counts their
  bytes from then on). It runs right after the last prefill chunk
  and before the first decode writes: a decode would overwrite what a sliding
  layer's snapshot needs. On a model with recurrent layers it runs one token
  before the prompt's end (prefill stops there: the recurrent rule,
  backends.base.clone_positions), so the same prompt sent again, whose match is
  at most len - 1, is served;
- a follower's clone order is served the moment its donor has committed the
  target (the donor's chunk stops there), before the donor writes again;
- a donor that leaves hands what it committed to the follower that salvages
  most (follow.promote), cloned before its state is released;
- a donor with recurrent layers holds a state only at its position and its
  checkpoints (the recurrent rule): a clone asked of it where it holds
  none (it moved on since the loop looked, or it leaves below a follower's
  target) is served from the highest state it holds below, if any;
- every CloneDonor is answered by exactly one CloneDone (a session, a refusal,
  or "cancelled" for an order dropped while it waited): the control loop holds
  the clone's bytes until then;
- faults stay where they start (faults.py); optional work (a snapshot, a clone
  from the prefix cache) that fails for any reason falls back, to the next
  candidate or to none, and is counted;
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
from typing import Any, Callable, Sequence

from kvfork.backends import effects as e
from kvfork.backends.base import (Backend, CloneRefused, ModelInfo, Sampled, SamplerState, Session,
                           clone_positions)
from kvfork.server.engine import faults
from kvfork.server.engine import messages as m
from kvfork.server.engine import plan as p
from kvfork.server.engine.clone_orders import CloneOrders
from kvfork.server.engine.constraints import ConstrainedRows
from kvfork.server.engine.rates import RateTracker, split_pass
from kvfork.server.engine.scheduler import Running, TimeBudget, plan_step
from kvfork.server.engine.drafts import Draft, Drafts, RequestDrafts
from kvfork.server.engine.speculation import draft_cap

log = logging.getLogger("kvfork.engine")


@dataclass
class Seq:
    """A request in an inference slot, as the runner runs it."""

    start: m.Start
    sid: int
    session: Session
    sampler: SamplerState
    prefilled: int = 0
    generated: int = 0
    next_token: int | None = None  # sampled, not yet committed
    choices: list[m.Choice] = field(default_factory=list)  # opened when the prompt's last logits are in
    capture_at: int = 0  # where its prompt is snapshot (Start.capture), 0: nowhere
    drafts: RequestDrafts | None = None  # its drafter, where it speculates
    draft: Draft | None = None  # what this step's decode row carries after its token
    draft_from: int = 0  # its tokens generated before this step's decode row
    speculated: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafted, accepted]

    @property
    def rid(self) -> int:
        return self.start.rid

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
                 clone_mode: str = "share", plans: Callable[[p.StepPlan], None] | None = None,
                 drafts: Drafts | None = None, speculative_max_batch: int = 0):
        """`plans`: handed each step's plan before its forward pass runs. `drafts`: the drafters of
        speculative decoding (None: off), used while a step decodes at most `speculative_max_batch` rows."""
        self.backend, self.model_path, self.dtype, self.clone_mode = backend, model_path, dtype, clone_mode
        self.max_batch_tokens, self.prefill_chunk, self.max_step_s = max_batch_tokens, prefill_chunk, max_step_s
        # The step budget's own rates, from the step timings measured here (the
        # control loop keeps the cost model's, from the same StepStats).
        self._rates = RateTracker()
        self.inbox: collections.deque = collections.deque()  # control loop -> runner
        self.events: collections.deque = collections.deque()  # runner -> control loop
        self._notify, self._plans = notify, plans
        self._wake = threading.Event()
        self._ex = e.Executor(backend)
        self._ops: list[e.Op] = []  # run since the last plan took them
        self._running: dict[int, Seq] = {}
        self._opened: list[p.Sampler] = []  # samplers opened since the last plan
        self._orders = CloneOrders()
        self._rotation: int | None = None
        self._steps = 0
        self._stopping = False
        self._constrained: ConstrainedRows | None = None  # once the model is loaded (it knows the vocabulary)
        self._info: ModelInfo | None = None  # once loaded
        self._releases = 0  # Release commands run (m.Pooled)
        self._drafts, self._speculative_max_batch = drafts, speculative_max_batch
        self._draft_cap = 0  # most tokens a row drafts on the loaded model (0: it does not speculate)
        self.thread = threading.Thread(target=self._main, name="kvfork-runner", daemon=True)

    def send(self, command: Any) -> None:
        self.inbox.append(command)
        self._wake.set()

    # ---- thread body ----

    def _main(self) -> None:
        try:
            self.backend.set_clone_mode(self.clone_mode)  # type: ignore[arg-type]
            info = self._info = self.backend.load(self.model_path, self.dtype)
            self._constrained = ConstrainedRows(info.vocab_size)
            self._draft_cap = self._speculation(info)
            self._publish(m.Loaded(info, self.backend.memory(self.max_batch_tokens)))
        except Exception as exc:
            log.exception("model load failed")
            self._publish(m.Died(f"model load failed: {exc}"))
            return
        try:
            while not self._stopping:
                self._wake.clear()
                if self.inbox or self._running:
                    self.step()
                else:
                    self._wake.wait()
        except BaseException as exc:  # the thread is dying: say so, never leave the loop waiting
            log.exception("runner died")
            self._publish(m.Died(f"runner died: {exc!r}"))

    # ---- one step ----

    def step(self) -> p.StepPlan:
        """One cycle: take the loop's commands, plan, forward, commit (each row's progress; its token sampled), publish. Returns the plan it ran."""
        took = self.take_commands()
        t0, backend_s = time.perf_counter(), self._ex.seconds
        plan = self.plan()
        if self._plans is not None:
            self._plans(plan)
        pass_s = 0.0
        for rows in plan.passes():
            before = self._ex.seconds
            for group, logits in self.forward(rows):
                self.commit(plan, group, logits)
            pass_s = self._ex.seconds - before
        prefill_s = self._observe(plan, self._ex.seconds - backend_s, pass_s)
        self._serve_orders()
        self.publish(plan, took, time.perf_counter() - t0, self._ex.seconds - backend_s, prefill_s)
        return plan

    def plan(self) -> p.StepPlan:
        """The scheduler's rows for this step, with the ops run since the last plan."""
        running = [Running(rid, s.prefill_left, s.prefill_cap(self._orders.prefill_cap(rid, s.session.position,
                                                                                       s.prefill_left)))
                   for rid, s in self._running.items()]
        rates = self._rates.rates
        budget = TimeBudget(self.max_step_s, rates.decode_s, rates.step_s_per_token) if self.max_step_s else None
        drafted = self._draft_all([r.rid for r in running if r.prefill_left == 0])
        batch = plan_step(running, self.max_batch_tokens, self.prefill_chunk, self._rotation, budget, drafted)
        self._rotation = batch.last_prefilled
        decode = [self._decode_row(self._running[rid]) for rid in batch.decode]
        samples = [p.Sample(rid, rid) for rid in batch.decode]
        prefill = []
        for rid, n in batch.prefill:
            s = self._running[rid]
            at = s.session.position
            ends = s.prefill_left == n
            prefill.append(p.Row(rid, s.sid, s.start.prompt[at:at + n], ends, True))
            if ends:
                samples.append(p.Sample(rid, rid))
                for choice in s.choices:
                    self._opened.append(p.Sampler(choice.rid, choice.sampling, s.start.prompt))
                    samples.append(p.Sample(choice.rid, rid))
        self._steps += 1
        ops, self._ops = self._ops, []
        opened, self._opened = self._opened, []
        return p.StepPlan(self._steps, ops, opened, decode, prefill, samples, self.backend.mixed_batches)

    def _decode_row(self, s: Seq) -> p.Row:
        tokens = [s.next_token, *(s.draft.tokens if s.draft is not None else ())]
        return p.Row(s.rid, s.sid, tokens, True, False, len(tokens))  # type: ignore[list-item]

    def forward(self, rows: list[p.Row]) -> list[faults.Group]:
        return faults.forward(lambda rows: self._ex.run(p.pass_of(rows)), rows, self._fail)

    def commit(self, plan: p.StepPlan, group: list[p.Row | None], logits: Any) -> None:
        """Rows whose tokens are committed: prefill progress and captures; then each other choice over a
        prompt that is in opens and samples its first token; then the rows' own samples (plan.samples)."""
        at, starts = {}, p.offsets(group)
        total = starts[-1] + (group[-1].reads if group[-1] is not None else 1) if group else 0
        for i, row in enumerate(group):
            s = self._running.get(row.rid) if row is not None else None
            if s is None:
                continue
            at[s.rid] = starts[i]  # its logits row (a drafted row's first)
            if row.prefill:  # type: ignore[union-attr]
                s.prefilled += len(row.tokens)  # type: ignore[union-attr]
                if s.session.position == s.capture_at:
                    self._capture(s)
        own = set()
        for sample in plan.samples:
            if sample.row not in at or sample.row not in self._running:
                continue
            if sample.rid == sample.row:
                own.add(sample.rid)
            else:
                self._open_choice(self._running[sample.row], sample.rid, logits, at[sample.row], total)
        ready: list[Seq | None] = [None] * total
        for rid in own & at.keys():
            ready[at[rid]] = self._running[rid]
        walking = [(s, at[s.rid], s.generated) for s in ready if s is not None and s.draft is not None]
        if any(ready):
            self.sample(logits, ready)
        self._walk(logits, walking, total)

    def publish(self, plan: p.StepPlan, took: bool, step_s: float, backend_s: float, prefill_s: float) -> None:
        """Events for the loop: a step's StepStats, or, after commands alone, what the backend holds."""
        if not plan.passes():
            if took and not self._running:  # no step reports what the commands left held
                self.events.append(m.Holding(self.backend.live_sessions(), self.backend.total_bytes(),
                                             self._pooled(), self.backend.block_stats()))
            if self.events:
                self._notify()
            return
        committed = {rid: s.session.position for rid, s in self._running.items()}
        kept = {rid: s.session.kept for rid, s in self._running.items() if s.session.kept}
        backend = self.backend
        self._publish(m.StepStats(committed, backend.live_sessions(), backend.total_bytes(), step_s, backend_s,
                                  plan.prefill_tokens, prefill_s, kept, self._pooled(), backend.block_stats()))

    def _observe(self, plan: p.StepPlan, step_s: float, last_pass_s: float) -> float:
        """The step's backend time into the step budget's rates (a step that decoded: the whole step
        against its prefill tokens) and the prefill rate; returns the step's prefill time: its pass of
        prefill chunks, or the prefill part of its one mixed pass (rates.split_pass)."""
        tokens = plan.prefill_tokens
        if plan.decode and not plan.mixed:
            prefill_s = last_pass_s if plan.prefill else 0.0
        else:
            prefill_s = split_pass(len(plan.decode), tokens, step_s)[1]
        if plan.decode:
            self._rates = self._rates.observe_step(tokens, step_s)
        self._rates = self._rates.observe_prefill(tokens, prefill_s)
        return prefill_s

    @property
    def _rows(self) -> ConstrainedRows:
        assert self._constrained is not None, "no request runs before the model is loaded"
        return self._constrained

    def _run(self, op: e.Op) -> Any:
        """Run one session op; it goes into the next plan once it ran (one that raised changed nothing)."""
        result = self._ex.run(op)
        self._ops.append(op)
        return result

    def _publish(self, *events: Any) -> None:
        self.events.extend(events)
        self._notify()

    def _pooled(self) -> m.Pooled:
        return m.Pooled(self.backend.pooled_bytes(), self._releases)

    # ---- commands ----

    def take_commands(self) -> bool:
        """Run what the loop sent, in order; whether there was anything."""
        took = bool(self.inbox)
        while self.inbox:
            match self.inbox.popleft():
                case m.Start() as start:
                    self._start(start)
                case m.Cancel(rid=rid):
                    self._stop(rid, "cancelled")
                case m.Finish(rid=rid):
                    self._stop(rid, "stop")
                case m.CloneDonor() as order:
                    self._clone_donor(order)
                case m.Release(sids=sids):
                    self._run(e.Release(sids))
                    self._releases += 1
                case m.Spill() as spill:
                    self._spill(spill)
                case m.LoadState() as load:
                    self._load_state(load)
                case m.Stop():
                    self._orders = CloneOrders()  # nobody is left to hand anything over to
                    for s in list(self._running.values()):
                        self._end(s, "cancelled")
                    self._rows.close()
                    self._stopping = True
        self._serve_orders()
        if self.events:
            self._notify()
        return took

    def _start(self, start: m.Start) -> None:
        sid, reused, index, refused, clone_s = start.resume, start.resume_at, None, [], 0.0
        if start.donor is not None:
            t0 = time.perf_counter()
            sid, reused, reason = self._clone_of(*start.donor)
            if sid is None:
                self.events.append(m.CloneDone(start.rid, None, reason=reason))
                return
            clone_s = time.perf_counter() - t0
        try:
            for i, (source, upto) in enumerate(start.clone_from if sid is None else ()):
                try:
                    t0 = time.perf_counter()
                    sid, reused, index = self._clone(source, upto), upto, i
                    clone_s = time.perf_counter() - t0
                    break
                except CloneRefused as refusal:
                    refused.append(refusal.reason)
                except Exception as exc:  # optional work: the next candidate, or a cold start
                    log.warning("clone from the prefix cache for request %d failed: %r", start.rid, exc)
                    refused.append("error")
            if sid is None:
                sid, reused = self._ex.new_sid(), 0
                self._run(e.Open(sid))
            if start.keep_at:
                self._keep_at(sid, start.keep_at)
        except Exception as exc:
            log.exception("start failed")
            self.events.append(m.Started(start.rid, 0, None, refused))
            for rid in [start.rid] + [choice.rid for choice in start.choices]:
                self.events.append(m.Ended(rid, "error", 0, 0, error=f"start failed: {exc}"))
            return
        self._open(start, sid, list(start.choices))
        self.events.append(m.Started(start.rid, reused, index, refused, clone_s))

    def _open(self, start: m.Start, sid: int, choices: list[m.Choice], planned: bool = False) -> Seq:
        """`start`'s request takes its slot on session `sid`, with its sampler and its grammar's matcher
        (`planned`: the plan named its sampler already)."""
        capture_at = len(start.prompt) - 1 if self._info is not None and self._info.recurrent else len(start.prompt)
        s = self._running[start.rid] = Seq(start, sid, self._ex.sessions[sid],
                                           SamplerState(start.sampling, prompt=start.prompt), choices=choices,
                                           capture_at=capture_at if start.capture else 0)
        if not planned:
            self._opened.append(p.Sampler(start.rid, start.sampling, start.prompt))
        self._rows.start(start.rid, start.constraint)
        if self._draft_cap and self._drafts is not None:
            try:
                s.drafts = self._drafts.open(start.scope, start.prompt)
            except Exception as exc:  # optional work: it decodes without
                log.warning("opening a drafter for request %d failed: %r", start.rid, exc)
        return s

    def _clone(self, source: int, upto: int) -> int:
        """A new session holding [0, upto) of session `source` (raises CloneRefused and the rest)."""
        sid = self._ex.new_sid()
        self._run(e.Clone(sid, source, upto))
        return sid

    def _stop(self, rid: int, reason: str) -> None:
        """Cancel or Finish: the request leaves (a clone order it waits for is dropped, and answered)."""
        if self._orders.drop_recipient(rid):  # every order is answered, a dropped one too
            self.events.append(m.CloneDone(rid, None, reason="cancelled"))
        s = self._running.get(rid)
        if s is not None:
            self._end(s, reason)
        else:
            self._drop_choice(rid, reason)

    def _spill(self, command: m.Spill) -> None:
        """Optional work: a state that fails to export is simply not kept on disk."""
        state = None
        try:
            state = self._run(e.Export(command.sid))
        except Exception as exc:
            log.warning("exporting a prefix cache entry failed: %r", exc)
        self._run(e.Release([command.sid]))
        self.events.append(m.Exported(command.key, state))

    def _load_state(self, command: m.LoadState) -> None:
        """Optional work: a state that fails to load leaves its request to prefill."""
        t0, sid = time.perf_counter(), self._ex.new_sid()
        try:
            self._run(e.Import(sid, command.state))
        except Exception as exc:
            log.warning("loading a saved state for request %d failed: %r", command.rid, exc)
            self.events.append(m.StateLoaded(command.rid, None))
            return
        self.events.append(m.StateLoaded(command.rid, sid, self._ex.sessions[sid].position, time.perf_counter() - t0))

    def _keep_at(self, sid: int, positions: tuple[int, ...]) -> None:
        """Checkpoints at message boundaries are optional work: a backend that fails them runs on without."""
        try:
            self._run(e.KeepAt(sid, tuple(positions)))
        except Exception as exc:
            log.warning("keeping checkpoints at %s failed: %r", positions, exc)

    # ---- clones for followers ----

    def _clone_donor(self, command: m.CloneDonor) -> None:
        donor = self._running.get(command.donor)
        if donor is None:
            self.events.append(m.CloneDone(command.rid, None, reason="donor_gone"))
        elif donor.session.position < command.upto:
            self._orders.add(command)
        else:
            self._clone_for(command.rid, donor, command.upto)

    def _clone_of(self, donor_rid: int, upto: int) -> tuple[int, int, None] | tuple[None, int, str]:
        """`[0, upto)` of a running request's session (at most: a recurrent donor gives the highest
        state it holds at or below), with what it holds, or why not (a clone fails soft)."""
        donor = self._running.get(donor_rid)
        if donor is None:
            return None, 0, "donor_gone"
        if self._info is not None and self._info.recurrent:
            held = clone_positions(donor.session.position, self._info, donor.session.kept)
            upto = max((q for q in held if q <= upto), default=upto)  # none below: the clone is refused
        try:
            return self._clone(donor.sid, upto), upto, None
        except CloneRefused as refusal:
            return None, 0, refusal.reason
        except Exception as exc:
            log.warning("clone of request %d failed: %s", donor_rid, exc)
            return None, 0, "error"

    def _clone_for(self, rid: int, donor: Seq, upto: int, refused_reason: str | None = None) -> None:
        t0 = time.perf_counter()
        sid, upto, reason = self._clone_of(donor.rid, upto)
        if sid is not None:
            self.events.append(m.CloneDone(rid, sid, upto, seconds=time.perf_counter() - t0))
        else:
            self.events.append(m.CloneDone(rid, None, reason=refused_reason or reason))

    def _serve_orders(self) -> None:
        for order in self._orders.due({rid: s.session.position for rid, s in self._running.items()}):
            self._clone_for(order.rid, self._running[order.donor], order.upto)

    def _hand_over(self, s: Seq, usable: bool) -> None:
        """A donor with followers waiting is leaving: its heir gets what it committed, the rest plan again."""
        committed = min(s.session.position, len(s.start.prompt))
        heir, upto, others = self._orders.leaving(s.rid, committed, usable)
        if heir is not None:
            self._clone_for(heir.rid, s, upto, refused_reason="leader_gone")
        for order in others:
            self.events.append(m.CloneDone(order.rid, None, reason="leader_gone"))

    # ---- what a committed row leads to ----

    def _capture(self, s: Seq) -> None:
        prompt = s.start.prompt[:s.capture_at]
        try:
            snapshot = self._clone(s.sid, len(prompt))
        except CloneRefused as refusal:
            log.info("capture of request %d refused: %s", s.rid, refusal)
            self.events.append(m.Captured(s.rid, prompt, None))
            return
        except Exception as exc:  # optional work: the request goes on without a snapshot
            log.warning("capture of request %d failed: %r", s.rid, exc)
            self.events.append(m.Captured(s.rid, prompt, None, failed=True))
            return
        if s.session.kept:  # its message-boundary checkpoints go with the snapshot, which serves them
            try:
                self._run(e.MoveCheckpoints(s.sid, snapshot))
            except Exception as exc:  # optional work: the snapshot serves its own length only
                log.warning("moving checkpoints of request %d to its snapshot failed: %r", s.rid, exc)
        session = self._ex.sessions[snapshot]
        self.events.append(m.Captured(s.rid, prompt, snapshot, self.backend.session_bytes(session),
                                      kept=session.kept))

    def _open_choice(self, lead: Seq, rid: int, logits: Any, row: int, rows: int) -> None:
        """`lead`'s prompt is in and row `row` of `logits` is its last: choice `rid` starts from a clone at
        the prompt's full length (before `lead` decodes) and samples its first token from that row."""
        choice = next(c for c in lead.choices if c.rid == rid)
        lead.choices.remove(choice)
        start = replace(lead.start, rid=rid, sampling=choice.sampling, capture=False, choices=[])
        try:
            sid = self._clone(lead.sid, len(start.prompt))
        except Exception as exc:  # the clone of one choice fails that choice alone
            log.warning("the clone for choice request %d failed: %r", rid, exc)
            self.events.append(m.Ended(rid, "error", 0, 0, error=f"its clone failed: {exc!r}"))
            return
        s = self._open(start, sid, [], planned=True)
        self.events.append(m.Started(rid, len(start.prompt), None))
        self.sample(logits, [s if i == row else None for i in range(rows)])

    def _drop_choice(self, rid: int, reason: str) -> None:
        """A choice still waiting for its prompt leaves alone."""
        for s in self._running.values():
            if any(choice.rid == rid for choice in s.choices):
                s.choices = [choice for choice in s.choices if choice.rid != rid]
                self.events.append(m.Ended(rid, reason, 0, 0))
                return

    def sample(self, logits: Any, group: list[Seq | None]) -> None:
        """Sample the rows of `group`'s requests (None rows are sampled greedily and dropped)."""
        seqs = {s.rid: s for s in group if s is not None}

        def draw(rids: Sequence[int | None]) -> list[Sampled]:
            states = [seqs[rid].sampler if rid is not None else SamplerState(p.DISCARD) for rid in rids]
            return self._ex.sample(logits, self._rows.before_sample(list(rids), states))

        for rid, pick in faults.sample(draw, [s.rid if s is not None else None for s in group], self._fail):
            if rid in self._running:
                self._accept(self._running[rid], pick)

    def _accept(self, s: Seq, pick: Sampled) -> None:
        failure = self._rows.after_sample(s.rid, pick.token)
        if failure is not None:
            self._end(s, "error", error=failure, grammar_failed=True)
            return
        s.generated += 1  # the backend's sampler has appended the token to `sampler.output`
        if self._accepts(s, pick.token):  # counted before it may end
            s.speculated[s.draft.source][1] += 1  # type: ignore[union-attr]
        if pick.token in s.start.stop_ids:
            self._end(s, "stop")
            return
        self.events.append(m.Token(s.rid, pick))
        s.next_token = pick.token
        if s.generated >= s.start.max_tokens:
            self._end(s, "length")

    # ---- speculation (speculation.py) ----

    def _speculation(self, info: ModelInfo) -> int:
        """Most tokens a row drafts on this model; 0, said once, where the backend cannot roll it back."""
        if self._drafts is None:
            return 0
        if not self.backend.rolls_back:
            log.warning("speculative decoding off: %s cannot roll drafted tokens back on this model "
                        "(recurrent or sliding layers it cannot undo)", type(self.backend).__name__)
            return 0
        return draft_cap(info.sliding_windows)

    def _draft_all(self, decoding: list[int]) -> int:
        """Each decoding request's draft for this step (none in a step that is compute-bound); the tokens drafted."""
        on = 0 < len(decoding) <= self._speculative_max_batch
        total = 0
        for rid in decoding:
            s = self._running[rid]
            s.draft = self._propose(s) if on and s.drafts is not None and s.drafts.active else None
            s.draft_from = s.generated
            if s.draft is not None:
                total += len(s.draft.tokens)
                counts = s.speculated.setdefault(s.draft.source, [0, 0])
                counts[0] += len(s.draft.tokens)
        return total

    def _propose(self, s: Seq) -> Draft | None:
        """Its drafter's guess, cut to what may be verified: within its max_tokens (whose positions its
        reservation holds), the model's cap, the vocabulary and its grammar. A drafter that raises is dropped."""
        limit = min(self._draft_cap, s.start.max_tokens - s.generated - 1)
        if limit < 1:
            return None
        assert s.drafts is not None and self._info is not None
        try:
            draft = s.drafts.propose([*s.start.prompt, *s.sampler.output], limit)
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

    def _walk(self, logits: Any, walking: list[tuple[Seq, int, int]], rows: int) -> None:
        """The drafted rows after their first token (sampled with the rest): while the last draw equals
        the draft, the next row is sampled (speculation.py: greedy, or the rejection rule); then each
        is rolled back to what it accepted. `walking`: (request, its first logits row, its tokens
        generated before that row was sampled)."""
        accepted = {s.rid: 0 for s, _, _ in walking}
        j = 0
        while walking:
            going = []
            for s, at, before in walking:
                assert s.draft is not None
                took = s.generated == before + 1 and self._accepts(s, s.sampler.output[-1])
                accepted[s.rid] += took
                if took and s.rid in self._running:
                    going.append((s, at, s.generated))
                else:
                    self._verified(s, accepted[s.rid])
            walking, j = going, j + 1
            ready: list[Seq | None] = [None] * rows
            for s, at, _ in walking:
                ready[at + j] = s
            if walking:
                self.sample(logits, ready)

    @staticmethod
    def _accepts(s: Seq, token: int) -> bool:
        """Whether `token`, its latest, is the drafted one its row's position guessed."""
        j = s.generated - s.draft_from - 1
        return s.draft is not None and j < len(s.draft.tokens) and token == s.draft.tokens[j]

    def _verified(self, s: Seq, accepted: int) -> None:
        assert s.draft is not None
        if s.rid in self._running:
            if s.drafts is not None:
                s.drafts.verified(s.draft, accepted)
            self._roll_back(s)
        s.draft = None

    def _roll_back(self, s: Seq) -> bool:
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

    # ---- ends ----

    def _fail(self, rid: int, error: str) -> None:
        s = self._running.get(rid)
        if s is not None:
            log.warning("request %d failed: %s", rid, error)
            self._end(s, "error", error=error)

    def _end(self, s: Seq, reason: str, error: str | None = None, grammar_failed: bool = False) -> None:
        self._hand_over(s, usable=reason != "error")
        for choice in s.choices:  # it left before its prompt was in: its choices go with it
            self.events.append(m.Ended(choice.rid, reason, 0, 0, error, grammar_failed=grammar_failed))
        del self._running[s.rid]
        self._rows.end(s.rid)
        self._close_drafts(s, reason)
        named_sid, held, nbytes, frees = None, [], 0, 0
        if s.start.keep_session and reason != "error" and self._roll_back(s):
            named_sid = s.sid
            if s.session.kept or s.start.keep_at:  # an idle named session is priced without checkpoints
                self._keep_at(s.sid, ())
            held = (s.start.prompt + s.sampler.output)[:s.session.position]
            nbytes, frees = self.backend.session_bytes(s.session), self.backend.release_frees(s.session)
        else:
            self._run(e.Release([s.sid]))
        self.events.append(m.Ended(s.rid, reason, s.prefilled, s.generated, error, named_sid, held, nbytes, frees,
                                   self._pooled(), grammar_failed, {k: (d, a) for k, (d, a) in s.speculated.items()}))

    def _close_drafts(self, s: Seq, reason: str) -> None:
        """A finished output joins its scope's corpus (optional work)."""
        drafts, s.drafts = s.drafts, None
        if drafts is not None and reason != "error":
            try:
                drafts.close(s.sampler.output)
            except Exception as exc:
                log.warning("closing the drafter of request %d failed: %r", s.rid, exc)
