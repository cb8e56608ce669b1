"""The MLX backend: mlx-lm models and caches behind kvfork's backend interface.

A session is either standalone (its own mlx-lm cache per layer: `KVCache`,
`RotatingKVCache` of the window for sliding layers) or a row of the
persistent decode batch (batch.py). A hybrid's recurrent layers keep an
`ArraysCache` (recurrent.py), and a session may keep checkpoints of those
states at chosen positions (`keep_at`, the recurrent rule, base.clone_positions). Prefill runs
standalone; decode and verify (speculation's drafted rows) run the batch; clone copies from either into a new
standalone session (kvcopy.py). Under --kv-cache-dtype every KV cache of a session holds its rows as
kv_storage.py stores them (`stored`), and every copy moves those rows.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Collection, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from kvfork.backends.base import (Backend, BatchFailed, CloneRefused, KVStorage, ModelInfo, RowState, Sampled,
                                  SamplerState, SavedLayer, SavedState, Session, check_inputs, clone_refusal)
from kvfork.backends.device_memory import DeviceMemory, cpu_memory, metal_memory
from kvfork.backends.mlx import kvcopy, recurrent, sampling
from kvfork.backends.mlx.kv_storage import stored
from kvfork.backends.mlx.batch import DecodeBatch, cache_marks, unmoved
from kvfork.backends.mlx.last_token import last_logits, supports_last_position
from kvfork.backends.mlx.loading import load_model
from kvfork.backends.mlx.mlx_lm_caches import write_index
from kvfork.backends.mlx.vision import MLXVisionReader
from kvfork.backends.vision.positions import RopeShifts, shifts_upto


class MLXSession(Session):
    def __init__(self, caches: list[Any], held_from: list[int]):
        super().__init__()
        self.caches: list[Any] | None = caches  # None while a row of the decode batch
        # Oldest position each sliding layer holds for sure (the rule in base.py);
        # a clone made one short of its donor's position holds one less than the window.
        self.held_from = held_from
        self.lost = False  # its state went with an abandoned decode batch (batch.py): corrupt
        self.rope_shifts: RopeShifts = ()  # M-RoPE: where the next text position is not the slot (vision.py)


class MLXBackend(Backend):
    def __init__(self, group: Any = None):
        """`group`: an `mx.distributed` group to split the model over (loading.load_model); None: one rank."""
        self.group = group
        self.kv_storage, self.encoder_cache_bytes, self.batch_invariant = KVStorage(), 0, False  # as set before `load`
        self.vision: MLXVisionReader | None = None  # a model that reads images (vision.py)

    def set_kv_storage(self, storage: KVStorage) -> None:
        self.kv_storage = storage  # load refuses what MLX or the model's heads cannot take (kv_storage.py)

    def set_encoder_cache_bytes(self, nbytes: int) -> None:
        self.encoder_cache_bytes = nbytes

    def set_batch_invariant(self, on: bool) -> None:
        self.batch_invariant = on  # load refuses what MLX, the model or this CPU cannot take (ordered.py)

    def load(self, folder: str, dtype: str | None = None) -> ModelInfo:
        self.model, self.tokenizer, self.info, self._storage, self.vision = load_model(
            folder, dtype, self.group, self.kv_storage, self.encoder_cache_bytes, self.batch_invariant)
        self._windows = list(self.info.sliding_windows)
        self._sessions: dict[int, MLXSession] = {}
        self._batch = DecodeBatch(self.model)
        self._last_only = supports_last_position(self.model)
        return self.info

    def memory(self, step_tokens: int) -> DeviceMemory:
        """Apple Silicon's unified memory (MLX's wired limit raised to Metal's working set), else the CPU's."""
        weights = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        weights += self.vision.weight_bytes() if self.vision else 0  # a vision tower's, beside them (vision.py)
        return metal_memory(weights) if mx.metal.is_available() else cpu_memory(weights)

    def open_session(self) -> MLXSession:
        caches = [stored(c, self._storage) for c in make_prompt_cache(self.model)]
        return self._track(MLXSession(caches, [0] * len(self._windows)))

    def release(self, session: MLXSession) -> None:
        if self._sessions.pop(session.id, None) is None:
            return
        if self._batch.has(session):
            self._batch.release(session)
        session.caches, session.checkpoints, session.kept = None, {}, ()

    # Fault contract (base.BatchFailed): prefill runs one session at a time, so a failure leaves
    # the earlier sessions COMMITTED with their logits and the later ones UNTOUCHED; the session
    # that failed is UNTOUCHED only if none of its caches moved (the fault rule of batch.DecodeBatch), else
    # CORRUPT. Decode classifies the whole batch the same way. A `lost` session is CORRUPT in
    # any call, before anything runs.

    def prefill(self, sessions: Sequence[MLXSession], chunks: Sequence[Sequence[int]]) -> mx.array:
        check_inputs(sessions, chunks, self._sessions, self.info)
        if self.vision is not None:
            self.vision.check(chunks)  # a refusal before anything is written
        if not sessions:
            return mx.zeros((0, self.info.vocab_size), mx.float32)
        return mx.stack(self._standalone(sessions, chunks)).astype(mx.float32)

    # Speculative decoding, on models of full layers alone: verify rows are rows of the decode batch,
    # sharing its step with the plain decode rows (batch.DecodeBatch.step: each row writes its own
    # positions, padded to the longest), and `truncate` makes a row forget its last positions (a
    # standalone session trims its caches: mlx-lm's KVCache.trim). A rotating (sliding) cache past its
    # window and a recurrent state cannot be rolled back: those models do not speculate.
    pads_verify = True

    @property
    def rolls_back(self) -> bool:
        return not self.info.recurrent and not self._windows

    def verify(self, sessions: Sequence[MLXSession], chunks: Sequence[Sequence[int]], reads: Sequence[int]) -> mx.array:
        check_inputs(sessions, chunks, self._sessions, self.info)
        if not self.rolls_back:
            raise ValueError("only a model of full-attention layers rolls drafted tokens back here")
        if any(not 1 <= n <= len(chunk) for n, chunk in zip(reads, chunks)):
            raise ValueError("each row reads between 1 and all of its positions")
        if not sessions:
            return mx.zeros((0, self.info.vocab_size), mx.float32)

        def run(rows: list[int], row_chunks: list[Sequence[int]]) -> tuple[mx.array, dict]:
            logits = self._batch.step(row_chunks)
            return mx.concatenate([logits[row, len(chunk) - n:len(chunk)]
                                   for row, chunk, n in zip(rows, chunks, reads)]), {}

        return self._batched(sessions, chunks, run)

    def truncate(self, session: MLXSession, position: int) -> None:
        if session.id not in self._sessions or session.lost:
            raise ValueError(f"{session!r} was released or lost")
        if not self.rolls_back or position > session.position:
            raise ValueError(f"cannot roll {session!r} back to {position}")
        if self._batch.has(session):
            self._batch.forget(session, session.position - position)
        else:
            for cache in session.caches or ():
                cache.trim(session.position - position)
        session.position = position
        session.rope_shifts = shifts_upto(session.rope_shifts, position)

    def _standalone(self, sessions: Sequence[MLXSession], chunks: Sequence[Sequence[int]]) -> list[mx.array]:
        """Each session out of the decode batch runs its chunk (`_run_chunk`): its last logits."""
        self._refuse_lost(sessions)
        rows: list[mx.array] = []
        for session, chunk in zip(sessions, chunks):
            marks = None
            try:
                if self._batch.has(session):
                    self._batch.leave(session)
                marks = cache_marks(session.caches)
                logits, taken, shifts = self._run_chunk(session, chunk)
                mx.eval(logits, self._arrays(taken))
            except Exception as exc:
                if marks is None:  # failed while leaving the batch: the batch is not trustworthy
                    self._batch.abandon()
                kept = bool(marks) and unmoved(marks, cache_marks(session.caches))
                failed = RowState.UNTOUCHED if kept else RowState.CORRUPT
                later = [RowState.CORRUPT if s.lost else RowState.UNTOUCHED for s in sessions[len(rows) + 1:]]
                done = None  # the committed rows' logits, zeros after them
                if rows:
                    done = mx.stack([*rows, *[mx.zeros_like(rows[0])] * (len(sessions) - len(rows))])
                raise BatchFailed(exc, [RowState.COMMITTED] * len(rows) + [failed] + later,
                                  None if done is None else done.astype(mx.float32)) from exc
            self._advance(session, len(chunk))
            session.rope_shifts = shifts
            session.keep(taken)
            rows.append(logits)
        return rows

    def decode(self, sessions: Sequence[MLXSession], tokens: Sequence[int]) -> mx.array:
        check_inputs(sessions, [[t] for t in tokens], self._sessions, self.info)
        if not sessions:
            return mx.zeros((0, self.info.vocab_size), mx.float32)

        def run(rows: list[int], row_chunks: list[Sequence[int]]) -> tuple[mx.array, dict]:
            logits = self._batch.step(row_chunks)[mx.array(rows), 0]
            taken = {s: {s.position + 1: self._states(self._batch.caches, row)}
                     for s, row in zip(sessions, rows) if s.position + 1 in s.wanted}
            return logits, taken

        return self._batched(sessions, [[t] for t in tokens], run)

    def _batched(self, sessions: Sequence[MLXSession], chunks: Sequence[Sequence[int]],
                 run: Callable[[list[int], list[Sequence[int]]], tuple[mx.array, dict]]) -> mx.array:
        """The sessions as the decode batch's rows run one step, each writing its chunk (`run`, given
        their rows and the rows' chunks, the batch's rows left out writing none: its logits, the
        checkpoints taken per session)."""
        self._refuse_lost(sessions)
        marks = None
        try:
            rows = self._batch.sync(sessions)
            marks = self._batch.marks()
            row_chunks: list[Sequence[int]] = [[0]] * len(rows)
            row_shifts: list[tuple[RopeShifts, int]] = [((), 0)] * len(rows)
            for row, chunk, session in zip(rows, chunks, sessions):
                row_chunks[row], row_shifts[row] = chunk, (session.rope_shifts, session.position)
            with self.vision.decoding(row_shifts) if self.vision else nullcontext():
                logits, taken = run(rows, row_chunks)
            logits = logits.astype(mx.float32)
            mx.eval(logits, [self._arrays(t) for t in taken.values()])
        except Exception as exc:
            if marks is None or not unmoved(marks, self._batch.marks()):
                self._batch.abandon()  # joiners not yet absorbed keep their own caches: untouched
            raise BatchFailed(exc, [RowState.CORRUPT if s.lost else RowState.UNTOUCHED for s in sessions]) from exc
        for session, chunk in zip(sessions, chunks):
            self._advance(session, len(chunk))
            session.keep(taken.get(session, {}))
        return logits

    def sample(self, logits: mx.array, states: Sequence[SamplerState]) -> list[Sampled]:
        return sampling.sample(logits, states)

    def select_rows(self, logits: mx.array, rows: Sequence[int]) -> mx.array:
        return sampling.select_rows(logits, rows)

    def clone(self, session: MLXSession, upto: int) -> MLXSession:
        if session.lost:
            raise CloneRefused("lost", "its state went with a failed decode step")
        refusal = clone_refusal(session.position, upto, self.info, session.held_from, session.kept)
        if refusal is not None:
            raise refusal
        caches, held_from = [], []
        sliding = iter(zip(self._windows, session.held_from))
        row = self._batch.row(session) if self._batch.has(session) else None
        live = session.caches if row is None else self._batch.caches
        # The recurrent rule: the state at `upto` is the live one or a checkpoint's (clone_refusal).
        if upto != session.position and upto in session.checkpoints:
            states = iter([recurrent.copy_state(c) for c in session.checkpoints[upto]])
        else:  # (a model without recurrent layers has none)
            states = iter(self._states(live, row))
        for layer, cache in zip(self.info.layers, live):
            match layer.kind:
                case "recurrent":
                    caches.append(next(states))
                case "full":
                    caches.append(stored(kvcopy.clone_full(self._view(cache, row, session.position), upto),
                                         self._storage))
                case "sliding":
                    window, held = next(sliding)
                    copy, start = kvcopy.clone_sliding(self._view(cache, row, session.position), held, upto, window)
                    caches.append(stored(copy, self._storage))
                    held_from.append(start)
        mx.eval([kvcopy.arrays(c) for c in caches])
        clone = MLXSession(caches, held_from)
        clone.position = upto
        clone.rope_shifts = shifts_upto(session.rope_shifts, upto)
        return self._track(clone)

    def keep_at(self, session: MLXSession, positions: Collection[int]) -> None:
        if session.id not in self._sessions:
            raise ValueError(f"{session!r} was released")
        if not self.info.recurrent:
            return  # nothing to keep: every position clones from the live state
        session.wanted = frozenset(p for p in positions if p > 0)
        session.checkpoints = {p: states for p, states in session.checkpoints.items() if p in session.wanted}
        taken = {}
        if session.position in session.wanted and not session.lost:
            row = self._batch.row(session) if self._batch.has(session) else None
            taken[session.position] = self._states(session.caches if row is None else self._batch.caches, row)
            mx.eval(self._arrays(taken))
        session.keep(taken)

    def move_checkpoints(self, source: MLXSession, target: MLXSession) -> None:
        if source.id not in self._sessions or target.id not in self._sessions:
            raise ValueError("a session was released")
        source.hand_checkpoints_below(target)

    def export_state(self, session: MLXSession) -> SavedState:
        # A standalone copy at the session's position gives every layer in temporal order,
        # whether the session is standalone or a row of the decode batch.
        copy = self.clone(session, session.position)
        try:
            layers = []
            for layer, cache in zip(self.info.layers, copy.caches or ()):
                match layer.kind:
                    case "recurrent":
                        layers.append(SavedLayer("recurrent", tuple(_host(a) for a in cache.cache)))
                    case "full" | "sliding":
                        v = kvcopy.view(cache)
                        layers.append(SavedLayer(layer.kind, (_host(v.keys[0]), _host(v.values[0])), v.first))
            return SavedState(session.position, tuple(layers), session.rope_shifts)
        finally:
            self.release(copy)

    def import_state(self, state: SavedState) -> MLXSession:
        if len(state.layers) != len(self.info.layers):
            raise ValueError(f"{len(state.layers)} saved layers for a model of {len(self.info.layers)}")
        n, caches, held_from = state.position, [], []
        for layer, saved in zip(self.info.layers, state.layers):
            if saved.kind != layer.kind:
                raise ValueError(f"a saved {saved.kind} layer does not fit a {layer.kind} one")
            arrays = [_device(a) for a in saved.arrays]
            match layer.kind:
                case "recurrent":
                    cache = ArraysCache(len(arrays))
                    cache.cache = arrays
                    caches.append(cache)
                case "full":
                    full = kvcopy.clone_full(kvcopy.LayerView(arrays[0][None], arrays[1][None], 0), n)
                    caches.append(stored(full, self._storage))
                case "sliding":
                    assert layer.window is not None
                    view = kvcopy.LayerView(arrays[0][None], arrays[1][None], saved.first)
                    cache, start = kvcopy.clone_sliding(view, saved.first, n, layer.window)
                    caches.append(stored(cache, self._storage))
                    held_from.append(start)
        mx.eval([kvcopy.arrays(c) for c in caches])
        session = MLXSession(caches, held_from)
        session.position = n
        session.rope_shifts = state.rope_shifts
        return self._track(session)

    def session_bytes(self, session: MLXSession) -> int:
        kept = sum(c.nbytes for states in session.checkpoints.values() for c in states)
        if self._batch.has(session):
            return self._batch.row_bytes() + kept
        return sum(c.nbytes for c in session.caches or ()) + kept

    def total_bytes(self) -> int:
        kept = sum(c.nbytes for s in self._sessions.values() for states in s.checkpoints.values() for c in states)
        standalone = sum(c.nbytes for s in self._sessions.values() if not self._batch.has(s) for c in s.caches or ())
        return standalone + self._batch.nbytes() + kept

    def live_sessions(self) -> int:
        return len(self._sessions)

    def to_numpy(self, logits: mx.array) -> np.ndarray:
        return np.array(logits.astype(mx.float32))

    def _refuse_lost(self, sessions: Sequence[MLXSession]) -> None:
        if any(s.lost for s in sessions):
            rows = [RowState.CORRUPT if s.lost else RowState.UNTOUCHED for s in sessions]
            raise BatchFailed(RuntimeError("the session's state was lost in a failed decode step"), rows)

    def _track(self, session: MLXSession) -> MLXSession:
        self._sessions[session.id] = session
        return session

    @staticmethod
    def _view(cache: Any, row: int | None, position: int) -> kvcopy.LayerView:
        if row is None:
            return kvcopy.view(cache)
        # A full layer's row is right-aligned at the batch's write index.
        return kvcopy.view(cache, row, position, (write_index(cache) or 0) - position)

    def _run_chunk(self, session: MLXSession,
                   chunk: Sequence[int]) -> tuple[mx.array, dict[int, list[ArraysCache]], RopeShifts]:
        """The chunk's last logits, running it in pieces that end at the wanted checkpoints inside
        it (the engine's chunk ends are a hint; a checkpoint is exact wherever it falls); the
        recurrent states taken there, not yet kept: a chunk that fails keeps none; the session's M-RoPE
        shifts after it."""
        start, taken = session.position, {}
        cuts = sorted(p - start for p in session.wanted if start < p < start + len(chunk))
        inputs = self.vision.reading(chunk, start, session.rope_shifts) if self.vision \
            else nullcontext((mx.array(list(chunk))[None], None, session.rope_shifts))
        with inputs as (tokens, embedded, shifts):  # a vision model's keys as embeddings (vision.py)
            for a, b in zip([0, *cuts], [*cuts, len(chunk)]):
                logits = last_logits(self.model, tokens[:, a:b], session.caches, self._last_only,
                                     None if embedded is None else embedded[:, a:b])[0]
                if start + b in session.wanted:
                    taken[start + b] = self._states(session.caches, None)
        return logits, taken, shifts

    def _states(self, caches: Sequence[Any], row: int | None) -> list[ArraysCache]:
        """Copies of the recurrent layers' states of a standalone session (row None) or a batch row."""
        return [recurrent.copy_state(c, row) for c, layer in zip(caches, self.info.layers) if layer.kind == "recurrent"]

    @staticmethod
    def _arrays(taken: dict[int, list[ArraysCache]]) -> list[mx.array]:
        return [a for states in taken.values() for c in states for a in kvcopy.arrays(c)]

    def _advance(self, session: MLXSession, n: int) -> None:
        session.position += n
        session.held_from = [max(h, session.position - w) for h, w in zip(session.held_from, self._windows)]


def _host(array: mx.array) -> np.ndarray:
    """An array on the host: bfloat16 as its uint16 bits (the saved-state rule, base.SavedState)."""
    return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)


def _device(array: np.ndarray) -> mx.array:
    # uint16 is only ever bfloat16's bits here: no model state is stored as integers
    return mx.array(array).view(mx.bfloat16) if array.dtype == np.uint16 else mx.array(array)
