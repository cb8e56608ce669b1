"""Loading a model into its ModelState: the engine's weights and the tokenizer together, then the prefix cache's
warm prompts; the daemon's one model and each model of a pool load so."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvfork.backends.base import Backend
from kvfork.backends.vision import load_processing
from kvfork.server.common.config import ServerConfig
from kvfork.server.common.state import ModelState
from kvfork.server.generate.chat_output import ModelFormats, start_formats
from kvfork.server.launch.warm import warm
from kvfork.server.text.tokenizer import PromptTokenizer

log = logging.getLogger("kvfork")


def load_tokenizer(config: ServerConfig, path: str) -> PromptTokenizer:
    """The model's tokenizer, with the operator's chat template (--chat-template) where one is set."""
    template = Path(config.chat_template).read_text(encoding="utf-8") if config.chat_template else None
    tokenizer = PromptTokenizer.load(path, template, config.template_timeout)
    tokenizer.vision = load_processing(path, tokenizer.tokenizer)
    return tokenizer


def tokenizer_alone(config: ServerConfig, path: str) -> tuple[PromptTokenizer, ModelFormats]:
    """A model's tokenizer and its formats, loaded without its weights (a pool's count_tokens)."""
    tokenizer = load_tokenizer(config, path)
    return tokenizer, ModelFormats.of(tokenizer, config.tool_parser, config.reasoning_parser)


async def load_model(state: ModelState, path: str, tokenizer: PromptTokenizer | None = None) -> None:
    """Load `path` into `state.engine` and `state.tokenizer` (`tokenizer`: the one an earlier load of this folder
    made, rather than loading it again), warm the prefix cache, and enter "ready"."""
    config, progress = state.config, state.progress
    progress.enter("loading", Path(path).name)
    if tokenizer is None:
        _, tokenizer = await asyncio.gather(state.engine.start(), asyncio.to_thread(load_tokenizer, config, path))
    else:
        await state.engine.start()
    state.tokenizer, state.formats = tokenizer, ModelFormats.of(tokenizer, config.tool_parser, config.reasoning_parser)
    warning = await start_formats(tokenizer, state.formats, config.tool_parser)
    if warning:
        log.warning(warning)
    if config.prefix_cache_warm:
        progress.enter("warming", config.prefix_cache_warm)
        await warm(state.engine, state.tokenizer, config.prefix_cache_warm)
    progress.enter("ready")


@dataclass(frozen=True)
class Loader:
    """A pool's `ModelLoader` (server/pool/served.py): a fresh backend per load, loaded as the daemon's one model is."""

    config: ServerConfig
    make_backend: Callable[[], Backend]

    def backend(self) -> Backend:
        return self.make_backend()

    async def load(self, state: ModelState, path: str, tokenizer: PromptTokenizer | None) -> None:
        await load_model(state, path, tokenizer)

    def tokenizer(self, path: str) -> tuple[PromptTokenizer, ModelFormats]:
        return tokenizer_alone(self.config, path)
