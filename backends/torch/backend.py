"""The torch backend: our own model code, CUDA first, the CPU for tests.

The device comes from `KVFORK_DEVICE` (cpu, cuda, cuda:1), else CUDA when
present. A clone shares the whole blocks below its `upto` by reference and copies
the rest (kv.py; --clone-mode copy copies it all). On CUDA a clone copies on a side stream; both sessions carry the copy's
event and the runner's stream waits on it before either one is next used, so
the copy overlaps whatever the runner does meanwhile.

This class holds the sessions, the forward passes, clones and the byte accounting; a model comes
in through loading.py (read, built, described), and a session's state goes to and from the host
through saved.py (the saved-state rule).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Collection, Sequence

import torch

from kvfork.backends.base import (Backend, BatchFailed, BlockStats, KVStorage, KVStorageRefused, ModelInfo, RowState,
                                  Sampled, SamplerState, SavedState, Session, check_inputs, clone_refusal)
from kvfork.backends.device_memory import DeviceMemory, cpu_memory, cuda_memory
from kvfork.backends.model_info import ModelFacts, read_model_facts
from kvfork.backends.model_path import resolve_model
from kvfork.backends.torch import hybrid, images, kv, kv_storage, loading, ordered_attention, parallel, sampling, saved
from kvfork.backends.torch.config import ArchConfig, HybridConfig
from kvfork.backends.torch.gated_delta import RecurrentState
from kvfork.backends.torch.hybrid import HybridTransformer
from kvfork.backends.torch.model import Transformer, VarlenRow
from kvfork.backends.torch.vision import VisionReader, split_weights
from kvfork.backends.vision.positions import RopeShifts, shifts_upto

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchSession(Session):
    def __init__(self) -> None:
        super().__init__()
        self.table: kv.BlockTable | None = None  # its full layers' blocks (None once released)
        self.layers: list[kv.LayerKV | hybrid.HybridLayerState] = []
        self.ready: torch.cuda.Event | None = None  # a clone's copy this session's next use must wait for
        self.rope_shifts: RopeShifts = ()  # M-RoPE: where the next text position is not the slot (vision/positions.py)


def checkpoint_pieces(session: TorchSession, length: int) -> list[tuple[int, int]]:
    """A chunk of `length` cut where the session wants a checkpoint inside it: (from, to) offsets
    (the engine's chunk ends are a hint; a checkpoint is exact wherever it falls)."""
    start = session.position
    cuts = sorted(p - start for p in session.wanted if start < p < start + length)
    return list(zip([0, *cuts], [*cuts, length]))


def default_device() -> torch.device:
    return torch.device(os.environ.get("KVFORK_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class TorchBackend(Backend):
    def __init__(self, device: str | None = None, shards: parallel.Shards | None = None):
        """`shards`: this process's rank of a tensor-parallel group (parallel.py); None: the whole model."""
        # At most the machine's cores (two backends in one process must not fight); fewer when
        # OMP_NUM_THREADS asks for it: on an oversubscribed CPU one thread can beat two.
        torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
        self.device = torch.device(device) if device else default_device()
        self.shards = shards
        self._sessions: dict[int, TorchSession] = {}
        self._copy_stream: torch.cuda.Stream | None = None
        self.clone_mode: kv.CloneMode = "share"
        self.kv_storage, self.encoder_cache_bytes, self.batch_invariant = KVStorage(), 0, False  # set before `load`
        self._source: tuple[str, str | None, str] | None = None  # (folder, dtype asked, device) of the loaded model
        self.vision: VisionReader | None = None  # a model that reads images: its tower and encoder cache

    def set_kv_storage(self, storage: KVStorage) -> None:
        self.kv_storage = storage

    def set_encoder_cache_bytes(self, nbytes: int) -> None:
        self.encoder_cache_bytes = nbytes

    def set_batch_invariant(self, on: bool) -> None:
        self.batch_invariant = on

    def set_clone_mode(self, mode: kv.CloneMode) -> None:
        self.clone_mode = mode

    # -- model -----------------------------------------------------------

    def load(self, folder: str, dtype: str | None = None) -> ModelInfo:
        path = resolve_model(folder)
        self.vision = None
        source, kept, self.reusable = (str(path), dtype, str(self.device)), self.reusable, None
        if isinstance(kept, loading.Built) and kept.source == source:
            self.dtype, self._source = kept.model_dtype, source
            storage = kv_storage.storage_for(self.kv_storage, self.dtype, kept.cfg.head_dim, self.device)
            self._adopt(kept.model, kept.cfg, path.name, read_model_facts(path), storage)
            return self.info
        cfg, weights, split = loading.read(path, self.device, self.shards)
        weights, tower = split_weights(path, weights, self.shards is not None)
        # handed over for a later load: neither a rank's part nor a model that reads images (its tower)
        self._source = source if self.shards is None and tower is None else None
        info = self.install(cfg, weights, path.name, read_model_facts(path), dtype, split)
        if tower is not None:  # a model that reads images (backends/torch/vision.py)
            self.vision = VisionReader(path, tower, self.device, self.dtype, self.encoder_cache_bytes, cfg.hidden_size)
            self.info = dataclasses.replace(info, reads_images=True, image_token_bytes=self.vision.token_bytes)
        return self.info

    def built(self) -> loading.Built | None:
        return loading.Built(self._source, self.dtype, self.model, self.cfg) if self._source is not None else None

    def install(self, cfg: ArchConfig | HybridConfig, weights: dict[str, torch.Tensor], name: str, facts: ModelFacts,
                dtype: str | None = None, split: bool = False) -> ModelInfo:
        """Take a model from weights already in memory (HF names; `split`: with `shards`, already this
        rank's parts, parallel.local_weight); `load` reads them from a folder, tools/gpu_check.py makes
        random ones of realistic shapes."""
        self.dtype = DTYPES[dtype] if dtype else default_dtype(self.device)
        storage = kv_storage.storage_for(self.kv_storage, self.dtype, cfg.head_dim, self.device)  # refused before the build
        if self.kv_storage.dtype == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            raise KVStorageRefused(f"--kv-cache-dtype fp8: torch {torch.__version__} has no float8 type")
        model, cfg = loading.build(cfg, weights, self.device, self.dtype, self.shards, split)
        self._adopt(model, cfg, name, facts, storage)
        return self.info

    def _adopt(self, model: Transformer | HybridTransformer, cfg: ArchConfig | HybridConfig, name: str,
               facts: ModelFacts, storage: kv_storage.Storage) -> None:
        """Serve `model` (built, in eval mode): a KV pool of its layout in `storage` and its description."""
        loading.set_batch_invariant(model, cfg, self.batch_invariant)
        storage.invariant = self.batch_invariant
        self.model, self.cfg = model, cfg
        self.pool = kv.BlockPool(loading.full_layers(self.cfg), self.cfg.num_kv_heads, self.cfg.head_dim, storage,
                                 self.device)
        self.info = loading.describe(self.cfg, name, facts, self.dtype, self.device, self.clone_mode == "share",
                                     storage, self.kv_storage)

    @property
    def state_format(self) -> str:  # under --batch-invariant, with the reading its bits depend on
        return super().state_format + ordered_attention.reading_name(self.pool.storage)

    def memory(self, step_tokens: int) -> DeviceMemory:
        """On CUDA the device's own memory, with a step's activation peak measured as vLLM profiles it."""
        weights = loading.weight_bytes(self.model, *([self.vision.tower] if self.vision else []))
        if self.device.type != "cuda":
            return cpu_memory(weights)
        return cuda_memory(self.device, weights, activation_peak(self, step_tokens) if step_tokens else 0)

    # -- sessions --------------------------------------------------------

    def open_session(self) -> TorchSession:
        session = TorchSession()
        session.table = kv.BlockTable.empty(self.pool, session.id)
        session.layers = self._new_layers(session.table)
        self._sessions[session.id] = session
        return session

    def _new_layers(self, table: kv.BlockTable) -> list[kv.LayerKV | hybrid.HybridLayerState]:
        cfg = self.cfg
        if isinstance(cfg, HybridConfig):
            return hybrid.new_states(cfg, table, self.dtype, self.device)
        return kv.new_layers(cfg.sliding, table, cfg.num_kv_heads, cfg.head_dim, self.device)

    def release(self, session: TorchSession) -> None:
        if self._sessions.pop(session.id, None) is not None:
            assert session.table is not None
            session.table.release()
            session.table, session.layers, session.checkpoints, session.kept = None, [], {}, ()

    def _wait_for_clones(self, sessions: Sequence[TorchSession]) -> None:
        for s in sessions:
            if s.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(s.ready)
                s.ready = None

    # -- compute ---------------------------------------------------------

    # One forward pass per call: prefill takes rows of any length (one-token decode rows too) and
    # runs them all in one varlen batch (model.VarlenRow), so a step that decodes some sessions and
    # prefills others reads the weights once (`mixed_batches`).
    #
    # Fault contract (base.BatchFailed): one pass writes every row, so a failure leaves each
    # session UNTOUCHED unless one of its rings or recurrent states was written (kv.py: writes past
    # `position` in a growing buffer are invisible), else CORRUPT; none is COMMITTED. `position` advances only
    # once the pass has returned.

    mixed_batches = True

    @torch.inference_mode()
    def prefill(self, sessions: Sequence[TorchSession], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        check_inputs(sessions, chunks, self._sessions, self.info)
        if not sessions:
            return torch.zeros((0, self.info.vocab_size), device=self.device)
        return self._forward(sessions, chunks, None)

    # Speculative decoding: a verify pass is one prefill pass reading more positions' logits. A full
    # layer rolls back by its position alone (writes past it are invisible); a ring first keeps the
    # entries the pass overwrites (kv.RingKV.keep_undo), which `truncate` puts back. A recurrent state
    # cannot roll back without a checkpoint per drafted position: hybrids do not speculate.

    @property
    def rolls_back(self) -> bool:
        return not isinstance(self.cfg, HybridConfig)

    @torch.inference_mode()
    def verify(self, sessions: Sequence[TorchSession], chunks: Sequence[Sequence[int]],
               reads: Sequence[int]) -> torch.Tensor:
        check_inputs(sessions, chunks, self._sessions, self.info)
        if not self.rolls_back:
            raise ValueError("a model with recurrent layers cannot roll drafted tokens back")
        if any(not 1 <= n <= len(chunk) for n, chunk in zip(reads, chunks)):
            raise ValueError("each row reads between 1 and all of its positions")
        for s, chunk in zip(sessions, chunks):
            kv.keep_ring_undo(s.layers, s.position, len(chunk))
        return self._forward(sessions, chunks, list(reads))

    @torch.inference_mode()
    def truncate(self, session: TorchSession, position: int) -> None:
        if session.id not in self._sessions:
            raise ValueError(f"{session!r} was released")
        if position > session.position or not kv.rings_undoable(session.layers, position):
            raise ValueError(f"cannot roll {session!r} back to {position}")
        kv.undo_rings(session.layers, position)
        session.position = position
        session.rope_shifts = shifts_upto(session.rope_shifts, position)

    def _forward(self, sessions: Sequence[TorchSession], chunks: Sequence[Sequence[int]],
                 reads: list[int] | None) -> torch.Tensor:
        """One pass (pieces where checkpoints cut a chunk); each row's last logits, or its last reads[i]."""
        writes = [hybrid.in_place_writes(s.layers) for s in sessions]
        shifts = {i: s.rope_shifts for i, s in enumerate(sessions)}
        starts = [s.position for s in sessions]
        # image keys as the placeholder's id, and each row's images (a refusal, before anything is written)
        chunks, placed = self.vision.read(chunks, starts, self.cfg) if self.vision else (chunks, [()] * len(chunks))
        try:
            self._wait_for_clones(sessions)
            pieces = [checkpoint_pieces(s, len(chunk)) for s, chunk in zip(sessions, chunks)]
            for s, chunk in zip(sessions, chunks):
                kv.reserve(s.layers, s.position + len(chunk))  # every allocation before the first write
            out: list[torch.Tensor | None] = [None] * len(sessions)
            taken: dict[int, dict[int, list[RecurrentState]]] = {}
            # One pass for all rows; a row cut at checkpoints inside its chunk runs its later pieces in
            # further passes, each taking the recurrent states where a piece ends on a wanted position.
            for piece in range(max(len(p) for p in pieces)):
                now = [i for i, p in enumerate(pieces) if piece < len(p)]
                rows = [VarlenRow(sessions[i].layers, starts[i] + pieces[i][piece][0],
                                  pieces[i][piece][1] - pieces[i][piece][0]) for i in now]
                row_images = [placed[i] for i in now]
                ids = torch.tensor([t for i in now for t in chunks[i][pieces[i][piece][0]:pieces[i][piece][1]]],
                                   dtype=torch.long, device=self.device)
                positions, after = images.positions(rows, [shifts[i] for i in now], row_images, self.cfg, self.device)
                shifts.update(zip(now, after))
                # reads: a verify pass, no checkpoint cuts it; images: only on a model of model.py (check_rows)
                logits = self.model(ids, positions, rows, reads=reads, images=row_images if any(row_images) else None)
                for row, i in enumerate(now):
                    end = starts[i] + pieces[i][piece][1]
                    if piece == len(pieces[i]) - 1:
                        out[i] = logits[row] if reads is None else logits[sum(reads[:i]):sum(reads[:i + 1])]
                    if end in sessions[i].wanted:
                        taken.setdefault(i, {})[end] = hybrid.recurrent_copies(sessions[i].layers)
        except Exception as exc:
            raise BatchFailed(exc, [self._after_failure(s, w) for s, w in zip(sessions, writes)]) from exc
        for i, (s, chunk) in enumerate(zip(sessions, chunks)):
            s.position += len(chunk)
            s.rope_shifts = shifts[i]
            s.keep(taken.get(i, {}))
        return torch.stack(out) if reads is None else torch.cat(out)  # type: ignore[arg-type]

    def decode(self, sessions: Sequence[TorchSession], tokens: Sequence[int]) -> torch.Tensor:
        return self.prefill(sessions, [[t] for t in tokens])

    @torch.inference_mode()
    def keep_at(self, session: TorchSession, positions: Collection[int]) -> None:
        if session.id not in self._sessions:
            raise ValueError(f"{session!r} was released")
        if not isinstance(self.cfg, HybridConfig):
            return  # nothing to keep: every position clones from the live state
        session.wanted = frozenset(p for p in positions if p > 0)
        session.checkpoints = {p: states for p, states in session.checkpoints.items() if p in session.wanted}
        self._wait_for_clones([session])
        session.keep({session.position: hybrid.recurrent_copies(session.layers)}
                     if session.position in session.wanted else {})

    @staticmethod
    def _after_failure(session: TorchSession, writes: int) -> RowState:
        return RowState.UNTOUCHED if hybrid.in_place_writes(session.layers) == writes else RowState.CORRUPT

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, states: Sequence[SamplerState]) -> list[Sampled]:
        return sampling.sample(logits, states)

    @torch.inference_mode()
    def select_rows(self, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        return sampling.select_rows(logits, rows)

    # -- clone -----------------------------------------------------------

    @torch.inference_mode()
    def clone(self, session: TorchSession, upto: int) -> TorchSession:
        if session.id not in self._sessions:
            raise ValueError(f"{session!r} was released")
        refusal = clone_refusal(session.position, upto, self.info, kv.held_from(session.layers), session.kept)
        if refusal is not None:
            raise refusal
        if self.device.type == "cuda":
            clone = self._clone_aside(session, upto)
        else:
            clone = self._clone_state(session, upto)
        clone.position = upto
        clone.rope_shifts = shifts_upto(session.rope_shifts, upto)
        self._sessions[clone.id] = clone
        return clone

    def _clone_aside(self, donor: TorchSession, upto: int) -> TorchSession:
        """Copy on the side stream, after every write already queued to the donor. The donor waits too: its ring
        entries are read by the copy and rewritten by its next step; record_stream keeps the allocator from
        handing either side's memory to another stream while the copy may still touch it."""
        main = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        side = self._copy_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            clone = self._clone_state(donor, upto)
            done = torch.cuda.Event()
            done.record(side)
        assert donor.table is not None and clone.table is not None
        for t in [*donor.table.tensors(), *(t for layer in [*donor.layers, *donor.checkpoints.get(upto, ())]
                                            for t in layer.tensors())]:
            t.record_stream(side)
        for t in [*clone.table.tensors(), *(t for layer in clone.layers for t in layer.tensors())]:
            t.record_stream(main)
        donor.ready = clone.ready = done
        return clone

    def move_checkpoints(self, source: TorchSession, target: TorchSession) -> None:
        if source.id not in self._sessions or target.id not in self._sessions:
            raise ValueError("a session was released")
        source.hand_checkpoints_below(target)

    def _clone_state(self, session: TorchSession, upto: int) -> TorchSession:
        """A session holding the state of [0, upto): the full layers' blocks by reference or copied
        (`clone_mode`), the rings copied, and the recurrent states copied, from the live state at the
        position, else from the checkpoint kept at `upto` (clone_refusal has admitted one of them; a
        model without recurrent layers keeps none and clones anywhere)."""
        assert session.table is not None
        clone = TorchSession()
        clone.table = session.table.clone(clone.id, upto, self.clone_mode)
        kept = iter(session.checkpoints.get(upto, ()))  # in recurrent layer order, where one was kept
        try:
            for layer in session.layers:
                if isinstance(layer, kv.FullKV):
                    clone.layers.append(kv.FullKV(clone.table, layer.layer))
                elif isinstance(layer, RecurrentState):
                    clone.layers.append(next(kept, layer).copy_prefix(upto))
                else:
                    clone.layers.append(layer.copy_prefix(upto))
        except BaseException:  # a clone that fails holds nothing
            clone.table.release()
            raise
        return clone

    # -- saved state (the saved-state rule, base.SavedState) -------------------------

    @torch.inference_mode()
    def export_state(self, session: TorchSession) -> SavedState:
        if session.id not in self._sessions:
            raise ValueError(f"{session!r} was released")
        self._wait_for_clones([session])
        return saved.export(session.layers, session.position, self.device, session.rope_shifts)

    @torch.inference_mode()
    def import_state(self, state: SavedState) -> TorchSession:
        session = self.open_session()
        try:
            saved.import_into(session.layers, state, self.device)
        except BaseException:
            self.release(session)
            raise
        session.position = state.position
        session.rope_shifts = state.rope_shifts
        return session

    # -- accounting ------------------------------------------------------

    @staticmethod
    def _unshared_bytes(session: TorchSession) -> int:
        """Its rings, recurrent states and checkpoints: never shared."""
        return kv.layers_bytes(session.layers) + sum(kv.layers_bytes(c) for c in session.checkpoints.values())

    def session_bytes(self, session: TorchSession) -> int:
        assert session.table is not None, f"{session!r} was released"
        return session.table.owned_bytes() + self._unshared_bytes(session)

    def release_frees(self, session: TorchSession) -> int:
        assert session.table is not None, f"{session!r} was released"
        return session.table.frees_bytes() + self._unshared_bytes(session)

    def pooled_bytes(self) -> int:
        return self.pool.pooled_bytes()

    def block_stats(self) -> BlockStats:
        return self.pool.stats()

    def total_bytes(self) -> int:
        return self.pool.total_bytes() + sum(self._unshared_bytes(s) for s in self._sessions.values())

    def live_sessions(self) -> int:
        return len(self._sessions)

    def to_numpy(self, logits: torch.Tensor):
        return logits.float().cpu().numpy()


def activation_peak(backend: TorchBackend, tokens: int) -> int:
    """Peak bytes one prefill of `tokens` tokens allocates on `backend`'s CUDA device beyond what was allocated
    before and the KV it keeps: run on a session released after."""
    device = backend.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    session = backend.open_session()
    try:
        backend.prefill([session], [[0] * min(tokens, backend.info.context_length)])
        torch.cuda.synchronize(device)
        kept = backend.session_bytes(session)
    finally:
        backend.release(session)
    return max(0, torch.cuda.max_memory_allocated(device) - before - kept)
