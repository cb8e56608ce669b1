"""One model of a pool: its engine (with its runner thread and backend) and the ModelState its requests read
(its tokenizer, formats and grammars). Its close can leave what its next load starts from (kept.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Protocol

from kvfork.backends.base import Backend
from kvfork.server.common.config import ServerConfig
from kvfork.server.common.state import ModelState
from kvfork.server.engine.cache.disk import kv_root
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.generate.chat_output import ModelFormats
from kvfork.server.pool.kept import Kept
from kvfork.server.pool.specs import ModelSpec
from kvfork.server.text.tokenizer import PromptTokenizer
from kvfork.server.watch.metrics import Registry
from kvfork.server.watch.observe import register_vllm_names


class ModelLoader(Protocol):
    """How a model is made and loaded, handed to the pool by the daemon that builds it (server/launch/
    model_load.py's `Loader`, over the `load_model` a daemon of one model calls): the pool decides when, never
    how."""

    def backend(self) -> Backend:
        """A fresh backend, for one load."""

    async def load(self, state: ModelState, path: str, tokenizer: PromptTokenizer | None) -> None:
        """The weights of `path` into `state.engine`, its tokenizer into `state` (`tokenizer`: the one an earlier
        load of the folder made), until ready."""

    def tokenizer(self, path: str) -> tuple[PromptTokenizer, ModelFormats]:
        """A model's tokenizer and its formats, without its weights."""


class ServedModel:
    def __init__(self, spec: ModelSpec, config: ServerConfig, engine_config: EngineConfig, backend: Backend,
                 kept: Kept | None = None):
        """`kept`: what a close of this model left, its folder unchanged since."""
        self.spec, self.kept = spec, kept
        self.registry = Registry()  # the model's own metrics, rendered with its model_name label
        # each model's disk tier in a folder of its own: a tier removes the files of other fingerprints it finds
        models = kv_root() / "models"
        for folder in (kv_root(), models):  # its files hold tenants' prompts: private, as the tier's folders are
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if kept is not None:
            backend.reuse(kept.built)
        self.engine = Engine(backend, spec.path, config.dtype, engine_config, self.registry,
                             kv_dir=models / spec.name.replace("/", "--"))
        self.state = ModelState(config, self.engine, [spec.name])
        register_vllm_names(self.registry, self.engine, spec.name)

    async def load(self, loader: ModelLoader) -> None:
        """Weights and tokenizer (downloaded first where the model is not here yet); raises what failed."""
        path = self.spec.path
        if self.spec.fetch is not None:
            path = self.engine.model_path = await asyncio.to_thread(self.spec.fetch, self.state.progress)
            self.spec = dataclasses.replace(self.spec, path=path, fetch=None)
        await loader.load(self.state, path, self.kept.tokenizer if self.kept is not None else None)

    async def close(self, grace_s: float, keep: bool = False) -> Kept | None:
        """Let running requests finish within `grace_s`, cancel the rest; the prefix cache spills to the disk
        tier (the engine's shutdown), so loading the model again restores it. `keep`: hand back the built model
        and the tokenizer (None where the backend has nothing to hand over)."""
        await self.engine.shutdown(grace_s)
        built = self.engine.backend.built() if keep and self.state.tokenizer is not None else None
        self.state.close(tokenizer=built is None)
        if self.kept is not None and self.state.tokenizer is not self.kept.tokenizer:
            self.kept.drop()  # a load cut short before it took the kept tokenizer
        return Kept(built, self.state.tokenizer) if built is not None else None  # type: ignore[arg-type]

    @property
    def weights_bytes(self) -> int:
        memory = self.engine.memory
        return memory.device.weights_bytes if memory is not None else 0
