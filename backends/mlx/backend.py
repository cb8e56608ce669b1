"""The MLX backend: mlx-lm models and caches behind kvfork's backend interface.

A session is either standalone (its own mlx-lm cache per layer: `KVCache`,
`RotatingKVCache` of the window for sliding layers) or a row of the
persistent decode batch (batch.py). Prefill runs standalone; decode runs the
batch; clone copies from either into a new standalone session (kvcopy.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from backends.base import Backend, ModelInfo, Sampled, SamplerState, Session, check_inputs, clone_refusal
from backends.mlx import kvcopy, sampling
from backends.mlx.batch import DecodeBatch
from backends.mlx.last_token import last_logits, supports_last_position
from backends.mlx.loading import load_model


class MLXSession(Session):
    def __init__(self, caches: list[Any], held_from: list[int]):
        super().__init__()
        self.caches: list[Any] | None = caches  # None while a row of the decode batch
        # Oldest position each sliding layer holds for sure (the rule in base.py);
        # a clone made one short of its donor's position holds one less than the window.
        self.held_from = held_from


class MLXBackend(Backend):
    def load(self, folder: str, dtype: str | None = None) -> ModelInfo:
        self.model, self.tokenizer, self.info = load_model(folder, dtype)
        self._windows = [layer.window for layer in self.info.layers if layer.kind == "sliding"]
        self._sessions: dict[int, MLXSession] = {}
        self._batch = DecodeBatch(self.model)
        self._last_only = supports_last_position(self.model)
        return self.info

    def open_session(self) -> MLXSession:
        return self._track(MLXSession(make_prompt_cache(self.model), [0] * len(self._windows)))

    def release(self, session: MLXSession) -> None:
        if self._sessions.pop(session.id, None) is None:
            return
        if self._batch.has(session):
            self._batch.release(session)
        session.caches = None

    def prefill(self, sessions: Sequence[MLXSession], chunks: Sequence[Sequence[int]]) -> mx.array:
        check_inputs(sessions, chunks, self._sessions, self.info)
        if not sessions:
            return mx.zeros((0, self.info.vocab_size), mx.float32)
        rows = []
        for session, chunk in zip(sessions, chunks):
            if self._batch.has(session):
                self._batch.leave(session)
            logits = last_logits(self.model, mx.array(chunk)[None], session.caches, self._last_only)[0]
            mx.eval(logits)
            self._advance(session, len(chunk))
            rows.append(logits)
        return mx.stack(rows).astype(mx.float32)

    def decode(self, sessions: Sequence[MLXSession], tokens: Sequence[int]) -> mx.array:
        check_inputs(sessions, [[t] for t in tokens], self._sessions, self.info)
        if not sessions:
            return mx.zeros((0, self.info.vocab_size), mx.float32)
        rows = self._batch.sync(sessions)
        row_tokens = [0] * len(rows)
        for row, token in zip(rows, tokens):
            row_tokens[row] = token
        logits = self._batch.step(row_tokens)
        logits = logits[mx.array(rows)].astype(mx.float32)
        mx.eval(logits)
        for session in sessions:
            self._advance(session, 1)
        return logits

    def sample(self, logits: mx.array, states: Sequence[SamplerState]) -> list[Sampled]:
        return sampling.sample(logits, states)

    def clone(self, session: MLXSession, upto: int) -> MLXSession:
        refusal = clone_refusal(session.position, upto, self.info, session.held_from)
        if refusal is not None:
            raise refusal
        caches, held_from = [], []
        sliding = iter(zip(self._windows, session.held_from))
        row = self._batch.row(session) if self._batch.has(session) else None
        for i, layer in enumerate(self.info.layers):
            match layer.kind:
                case "full":
                    caches.append(kvcopy.clone_full(self._view(session, i), upto))
                case "sliding":
                    window, held = next(sliding)
                    cache, start = kvcopy.clone_sliding(self._view(session, i), held, upto, window)
                    caches.append(cache)
                    held_from.append(start)
                case "recurrent":
                    source = session.caches[i] if row is None else self._batch.caches[i]
                    caches.append(kvcopy.recurrent(source, row))
        mx.eval([kvcopy.arrays(c) for c in caches])
        clone = MLXSession(caches, held_from)
        clone.position = upto
        return self._track(clone)

    def session_bytes(self, session: MLXSession) -> int:
        if self._batch.has(session):
            return self._batch.row_bytes()
        return sum(c.nbytes for c in session.caches or ())

    def total_bytes(self) -> int:
        standalone = sum(self.session_bytes(s) for s in self._sessions.values() if not self._batch.has(s))
        return standalone + self._batch.nbytes()

    def live_sessions(self) -> int:
        return len(self._sessions)

    def to_numpy(self, logits: mx.array) -> np.ndarray:
        return np.array(logits.astype(mx.float32))

    def _track(self, session: MLXSession) -> MLXSession:
        self._sessions[session.id] = session
        return session

    def _view(self, session: MLXSession, layer: int) -> kvcopy.LayerView:
        """The KV a full or sliding layer of the session holds, standalone or as a batch row."""
        if not self._batch.has(session):
            return kvcopy.view(session.caches[layer])
        cache = self._batch.caches[layer]
        # A full layer's row is right-aligned at the batch's write index.
        padding = getattr(cache, "_idx", 0) - session.position
        return kvcopy.view(cache, self._batch.row(session), session.position, padding)

    def _advance(self, session: MLXSession, n: int) -> None:
        session.position += n
        session.held_from = [max(h, session.position - w) for h, w in zip(session.held_from, self._windows)]
