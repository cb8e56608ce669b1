"""The runner: the one thread that owns the backend. Each step (`Runner.step`):

    take commands  the control loop's starts, ends, clone orders, releases, spills, state loads
    plan           the scheduler's decode rows and prefill chunks, as a StepPlan (plan.py)
    forward        the plan's pass(es), failures recovered row by row (faults.py)
    commit         each row's progress, captures and choices; then its token, sampled (`sample`)
                   and, for a drafted row, walked over its draft (speculation.py)
    publish        tokens, ends, every running request's committed position: events for the loop

It never waits on the loop: events go on a deque, and `notify` wakes the loop
(`call_soon_threadsafe`). With nothing to do it waits for a command, and once it has waited IDLE_SECONDS it
gives malloc's free pages back to the system (device_memory.give_back_free_heap).

Design rules:
- faults stay where they start (faults.py): a pass or a sample that fails is recovered row by
  row, and fails only the requests whose rows fail;
- grammar-constrained rows (constraints.py) join their mask just before a sample and hand the
  sampled token over just after it; nothing else here knows them;
- the commands (commands.py), the clones of running sessions (cloning.py) and speculation
  (speculation.py) state their own rules; the commands and the clones are parts with their own state,
  built once the model is loaded, and the step calls them through their public verbs.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Sequence

from kvfork.backends import effects as e
from kvfork.backends.base import Backend, KVStorage, KVStorageRefused, ModelInfo, Sampled, SamplerState
from kvfork.backends.device_memory import give_back_free_heap
from kvfork.backends.vision.keys import image_start
from kvfork.server.engine import messages as m
from kvfork.server.engine.policy.fair_share import sit_out
from kvfork.server.engine.policy.rates import RateTracker, split_pass
from kvfork.server.engine.policy.scheduler import Running, TimeBudget, plan_step
from kvfork.server.engine.worker import faults
from kvfork.server.engine.worker import plan as p
from kvfork.server.engine.worker.cloning import Cloning
from kvfork.server.engine.worker.commands import Commands
from kvfork.server.engine.worker.constraints import ConstrainedRows
from kvfork.server.engine.worker.drafts import Drafts
from kvfork.server.engine.worker.sequence import Seq
from kvfork.server.engine.worker.speculation import Speculation

log = logging.getLogger("kvfork.engine")

# A runner with nothing to do for this long gives the heap's free pages back to the system (give_back_free_heap):
# after a burst, not between its steps, where the pages would be faulted in again
IDLE_SECONDS = 0.2


class Runner:
    """The runner thread: its step, here; its parts, built once the model is loaded, each with its own state: the
    loop's commands (`Commands`, commands.py), the clones of running sessions (`Cloning`, cloning.py) and
    speculative decoding (`Speculation`, speculation.py)."""

    def __init__(self, backend: Backend, model_path: str, dtype: str | None,
                 max_batch_tokens: int, prefill_chunk: int, max_step_s: float, notify: Callable[[], None],
                 clone_mode: str = "share", plans: Callable[[p.StepPlan], None] | None = None,
                 drafts: Drafts | None = None, speculative_max_batch: int = 0,
                 kv_storage: KVStorage = KVStorage(), encoder_cache_bytes: int = 0, slots: int = 1,
                 batch_invariant: bool = False):
        """`plans`: handed each step's plan before its forward pass runs. `drafts`: the drafters of
        speculative decoding (None: off), used while a step decodes at most `speculative_max_batch` rows.
        `slots`: the inference slots, over which tenants' shares are counted (fair_share.sit_out)."""
        self.backend, self.model_path, self.dtype, self.clone_mode = backend, model_path, dtype, clone_mode
        self.kv_storage, self.encoder_cache_bytes = kv_storage, encoder_cache_bytes
        self.batch_invariant = batch_invariant
        self.max_batch_tokens, self.prefill_chunk, self.max_step_s = max_batch_tokens, prefill_chunk, max_step_s
        self.slots = slots
        self._sat_out: frozenset[str] = frozenset()  # the tenants whose rows waited out the last step
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
        self._paused: dict[int, Seq] = {}  # out of the batch, their sessions kept (m.Pause)
        self._opened: list[p.Sampler] = []  # samplers opened since the last plan
        self._rotation: int | None = None
        self._steps = 0
        self._constrained: ConstrainedRows | None = None  # once the model is loaded (it knows the vocabulary)
        self._info: ModelInfo | None = None  # once loaded
        self._cloning: Cloning  # its parts, once the model is loaded
        self._commands: Commands
        self._speculation: Speculation
        self._drafts, self._speculative_max_batch = drafts, speculative_max_batch
        self.thread = threading.Thread(target=self._main, name="kvfork-runner", daemon=True)

    def send(self, command: Any) -> None:
        self.inbox.append(command)
        self._wake.set()

    # ---- thread body ----

    def _main(self) -> None:
        try:
            self.backend.set_clone_mode(self.clone_mode)  # type: ignore[arg-type]
            self.backend.set_kv_storage(self.kv_storage)
            self.backend.set_batch_invariant(self.batch_invariant)
            self.backend.set_encoder_cache_bytes(self.encoder_cache_bytes)
            info = self._info = self.backend.load(self.model_path, self.dtype)
            self._constrained = ConstrainedRows(info.vocab_size)
            self._speculation = Speculation(self.backend, info, self._constrained, self._drafts,
                                            self._speculative_max_batch, self._running, self._run, self.sample,
                                            self._fail)
            self._cloning = Cloning(self.backend, self._ex, self._run, self._running, self._paused, self.events, info,
                                    self._open, self.sample)
            self._commands = Commands(self.inbox, self.events, self._notify, self.backend, self._ex, self._run,
                                      self._running, self._paused, self._constrained, self._cloning, self._open,
                                      self._end)
            self._publish(m.Loaded(info, self.backend.memory(self.max_batch_tokens)))
        except KVStorageRefused as exc:  # a setting this model or backend cannot take: the start's own error
            self._publish(m.Died(str(exc), refused=True))
            return
        except Exception as exc:
            log.exception("model load failed")
            self._publish(m.Died(f"model load failed: {exc}"))
            return
        try:
            while not self._commands.stopping:
                self._wake.clear()
                if self.inbox or self._running:
                    self.step()
                elif not self._wake.wait(IDLE_SECONDS):
                    give_back_free_heap()
                    self._wake.wait()
        except BaseException as exc:  # the thread is dying: say so, never leave the loop waiting
            log.exception("runner died")
            self._publish(m.Died(f"runner died: {exc!r}"))

    # ---- one step ----

    def step(self) -> p.StepPlan:
        """One cycle: take the loop's commands, plan, forward, commit (each row's progress; its token sampled), publish. Returns the plan it ran."""
        took = self._commands.take_commands()
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
        self._speculation.timed(plan, time.perf_counter() - t0)
        prefill_s = self._observe(plan, self._ex.seconds - backend_s, pass_s)
        self._cloning.serve_orders()
        self.publish(plan, took, time.perf_counter() - t0, self._ex.seconds - backend_s, prefill_s)
        return plan

    def plan(self) -> p.StepPlan:
        """The scheduler's rows for this step, but those of the tenants that wait it out (fair_share.sit_out),
        with the ops run since the last plan."""
        seqs = self._running.values()
        out = self._sat_out = sit_out([(s.tenant, s.prefill_left) for s in seqs], self.slots, self.prefill_chunk,
                                      self._sat_out)
        running = [Running(s.rid, s.prefill_left, s.prefill_cap(self._cloning.prefill_cap(s.rid, s.session.position,
                                                                                          s.prefill_left)), s.whole())
                   for s in seqs if s.tenant not in out]
        rates = self._rates.rates
        budget = TimeBudget(self.max_step_s, rates.decode_s, rates.step_s_per_token) if self.max_step_s else None
        drafted = self._speculation.draft_all([r.rid for r in running if r.prefill_left == 0])
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
        self._speculation.open_drafts(s)
        return s

    def _decode_row(self, s: Seq) -> p.Row:
        tokens = [s.next_token, *(s.draft.tokens if s.draft is not None else ())]
        return p.Row(s.rid, s.sid, tokens, True, False, len(tokens))  # type: ignore[list-item]

    def forward(self, rows: list[p.Row]) -> list[faults.Group]:
        return faults.forward(lambda rows: self._ex.run(p.pass_of(rows)), rows, self._fail)

    def commit(self, plan: p.StepPlan, group: list[p.Row | None], logits: Any) -> None:
        """Rows whose tokens are committed: prefill progress and captures; then each other choice over a
        prompt that is in opens and samples its first token; then the rows' own samples (plan.samples)."""
        at, starts = {}, p.offsets(group)
        for i, row in enumerate(group):
            s = self._running.get(row.rid) if row is not None else None
            if s is None:
                continue
            at[s.rid] = starts[i]  # its logits row (a drafted row's first)
            if row.prefill:  # type: ignore[union-attr]
                s.prefilled += len(row.tokens)  # type: ignore[union-attr]
                if s.session.position == s.capture_at:
                    self._cloning.capture(s)
        own = set()
        for sample in plan.samples:
            if sample.row not in at or sample.row not in self._running:
                continue
            if sample.rid == sample.row:
                own.add(sample.rid)
            else:
                self._cloning.open_choice(self._running[sample.row], sample.rid, logits, at[sample.row])
        ready = {at[rid]: self._running[rid] for rid in own & at.keys()}
        walking = [(s, row, s.generated) for row, s in sorted(ready.items()) if s.draft is not None]
        if ready:
            self.sample(logits, ready)
        self._speculation.walk(logits, walking)

    def publish(self, plan: p.StepPlan, took: bool, step_s: float, backend_s: float, prefill_s: float) -> None:
        """Events for the loop: a step's StepStats and Ledger, or, after commands alone, the Ledger."""
        if not plan.passes():
            if took:  # no step reports what the commands left held
                self.events.append(self._ledger())
            if self.events:
                self._notify()
            return
        committed = {rid: s.session.position for rid, s in self._running.items()}
        kept = {rid: s.session.kept for rid, s in self._running.items() if s.session.kept}
        self._publish(m.StepStats(committed, step_s, backend_s, plan.prefill_tokens, prefill_s, kept), self._ledger())

    def _observe(self, plan: p.StepPlan, step_s: float, last_pass_s: float) -> float:
        """The step's backend time into the step budget's rates (a step that decoded: the whole step
        against its prefill tokens) and the prefill rate; returns the step's prefill time: its pass of
        prefill chunks, or the prefill part of its one mixed pass (rates.split_pass)."""
        tokens, positions = plan.prefill_tokens, sum(row.reads for row in plan.decode)
        if plan.decode and not plan.mixed:
            prefill_s = last_pass_s if plan.prefill else 0.0
        else:
            prefill_s = split_pass(positions, tokens, step_s)[1]
        if plan.decode:
            self._rates = self._rates.observe_step(tokens, step_s, positions - len(plan.decode))
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

    def _ledger(self) -> m.Ledger:
        """What the backend holds now, for the loop's byte view."""
        b = self.backend
        return m.Ledger(b.live_sessions(), b.total_bytes(), b.pooled_bytes(), self._commands.releases, b.block_stats())

    # ---- sampling ----

    def sample(self, logits: Any, picked: dict[int, Seq]) -> None:
        """Sample the logits rows of `picked` (row -> its request), and no other row."""
        at = {s.rid: row for row, s in sorted(picked.items())}
        seqs = {s.rid: s for s in picked.values()}

        def draw(rids: Sequence[int]) -> list[Sampled]:
            states = self._rows.before_sample(list(rids), [seqs[rid].sampler for rid in rids])
            return self._ex.sample(logits, states, [at[rid] for rid in rids])

        for rid, pick in faults.sample(draw, list(at), self._fail):
            if rid in self._running:
                self._accept(self._running[rid], pick)

    def _accept(self, s: Seq, pick: Sampled) -> None:
        failure = self._rows.after_sample(s.rid, pick.token)
        if failure is not None:
            self._end(s, "error", error=failure, grammar_failed=True)
            return
        s.generated += 1  # the backend's sampler has appended the token to `sampler.output`
        if self._speculation.accepts(s, pick.token):  # counted before it may end
            s.speculated[s.draft.source][1] += 1  # type: ignore[union-attr]
        if pick.token in s.start.stop_ids:
            self._end(s, "stop")
            return
        self.events.append(m.Token(s.rid, pick))
        s.next_token = pick.token
        if s.generated >= s.start.max_tokens:
            self._end(s, "length")

    # ---- ends ----

    def _fail(self, rid: int, error: str) -> None:
        s = self._running.get(rid)
        if s is not None:
            log.warning("request %d failed: %s", rid, error)
            self._end(s, "error", error=error)

    def _off_image(self, s: Seq) -> bool:
        """A named session that stopped inside an image (its request ended mid-prefill) back to the image's first
        token: its next request resumes where every reuse point lies (keys.image_start), never inside an image,
        whatever its family computes an image's tokens together. False: it could not, and keeps nothing."""
        at = image_start(s.start.prompt, s.session.position)
        if at == s.session.position:
            return True
        try:
            self._run(e.Truncate(s.sid, at))
        except Exception as exc:
            log.warning("request %d: its named session could not go back to its image's start: %r", s.rid, exc)
            return False
        return True

    def _end(self, s: Seq, reason: str, error: str | None = None, grammar_failed: bool = False) -> None:
        self._cloning.hand_over(s, usable=reason != "error")
        for choice in s.choices:  # it left before its prompt was in: its choices go with it
            self.events.append(m.Ended(choice.rid, reason, 0, 0, error, grammar_failed=grammar_failed))
        self._running.pop(s.rid, None)
        self._paused.pop(s.rid, None)
        self._rows.end(s.rid)
        self._speculation.close_drafts(s, reason)
        if s.images:
            self.backend.release_images(s.images)
        named_sid, held, nbytes, frees = None, [], 0, 0
        if s.start.keep_session and reason != "error" and self._speculation.roll_back(s) and self._off_image(s):
            named_sid = s.sid
            if s.session.kept or s.start.keep_at:  # an idle named session is priced without checkpoints
                self._commands.keep_at(s.sid, ())
            held = (s.start.prompt + s.sampler.output)[:s.session.position]
            nbytes, frees = self.backend.session_bytes(s.session), self.backend.release_frees(s.session)
        else:
            self._run(e.Release([s.sid]))
        self.events.append(m.Ended(s.rid, reason, s.prefilled, s.generated, error, named_sid, held, nbytes, frees,
                                   self._ledger(), grammar_failed, {k: (d, a) for k, (d, a) in s.speculated.items()}))

