"""Run the daemon: listen first (so /health can say "loading"), load, serve until a signal.

Shutdown on SIGINT/SIGTERM: the engine stops admitting (new requests get 503),
in-flight requests get `--shutdown-grace` seconds to finish, the rest are
cancelled, then the listener closes. Tests drive the same `Daemon` class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, AsyncIterator

from kvfork.backends import create_backend, default_backend
from kvfork.backends.base import Backend, BackendRefused, KVStorageRefused
from kvfork.backends.lockstep.leader import LockstepBackend
from kvfork.server.common.config import ServerConfig
from kvfork.server.common.state import ModelState, OneModel, Services
from kvfork.server.engine.cache.disk import kv_root
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.guard.tenants import key_tenants
from kvfork.server.launch.listening import Listening
from kvfork.server.launch.model_load import load_model
from kvfork.server.launch.pool_daemon import PoolDaemon
from kvfork.server.pool.specs import Fetch, ModelSpec
from kvfork.server.watch.metrics import Registry
from kvfork.server.watch.observe import log_stats, register_vllm_names

GiB = 1024**3
log = logging.getLogger("kvfork")


class Daemon(Listening):
    def __init__(self, config: ServerConfig, engine_config: EngineConfig, model: str, backend: Backend,
                 fetch: Fetch | None = None):
        """`fetch`: how to download (and convert) a model not on this machine yet, done first in `load`."""
        self.config, self.model, self.fetch = config, model, fetch
        self.registry = Registry()
        self.kv_events = open_kv_events(config)
        self.engine = Engine(backend, model, config.dtype, engine_config, self.registry, kv_dir=kv_root(),
                             kv_events=self.kv_events)
        names = list(config.served_model_name) or [Path(model).name]
        self.state = ModelState(config, self.engine, names)  # the one model's
        self.services = Services(config, self.registry, OneModel(self.state))
        register_vllm_names(self.registry, self.engine, names[0])
        self.stats: asyncio.Task | None = None  # the stats line's (--log-stats)
        self.port = config.port

    async def load(self) -> None:
        progress = self.state.progress
        progress.start()
        if self.fetch is not None:
            self.model = self.engine.model_path = await asyncio.to_thread(self.fetch, progress)
        await load_model(self.state, self.model)
        if self.config.log_stats:
            self.stats = asyncio.create_task(log_stats(self.engine))

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Daemon]:
        """Listening and loaded for the block, closed after it (the tools' daemons: the soak, the hostile wave)."""
        await self.listen()
        try:
            await self.load()
            yield self
        finally:
            await self.close()

    async def close(self) -> None:
        self.state.progress.stop()
        if self.stats is not None:
            self.stats.cancel()
        await self.engine.shutdown(self.config.shutdown_grace)
        if self.listener is not None:
            await self.listener.close()
        self.state.close()
        self.services.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def memory_fits(self) -> bool:
        """Whether the KV budget holds one request at the full context (else: why not, on stderr); a budget
        beyond what the device holds is warned of."""
        plan = self.engine.memory
        if plan.refusal is not None:
            print(f"kvfork serve: error: {plan.refusal}", file=sys.stderr, flush=True)
            return False
        if plan.warning is not None:
            print(f"kvfork: warning: {plan.warning}", file=sys.stderr, flush=True)
        return True

    def loaded_line(self) -> str:
        info, c, plan = self.engine.info, self.engine.config, self.engine.memory
        assert info is not None and plan is not None
        cache_cap = f"{c.prefix_cache_bytes / GiB:.2f} GiB" if c.prefix_cache_bytes else "no cap of its own"
        return (
            f"kvfork: loaded {info.name} ({len(info.layers)} layers, {info.dtype} on {info.device}, "
            f"context {c.max_context}) as {', '.join(self.state.served_names)}\n"
            f"kvfork: KV budget {c.kv_budget_bytes / GiB:.2f} GiB{_held_tokens(plan.tokens)}: {plan.reason}\n"
            f"kvfork: set aside {c.kv_budget_bytes / GiB:.2f} GiB for KV state ({info.kv.full_bytes_per_token} "
            f"bytes/token): {c.inference_slots} inference slots, {c.max_captures} pending captures, prefix cache "
            f"of {c.prefix_cache_entries} entries ({cache_cap}){self._disk_line()}\n"
            f"kvfork: speculative decoding {self._speculation()}"
        )

    def _speculation(self) -> str:
        """The mode that runs: the one asked, unless the backend cannot roll drafted tokens back on this model."""
        mode = self.engine.config.speculative
        if mode == "off":
            return "off"
        if not self.engine.backend.rolls_back:
            return f"off ({mode} asked, but drafted tokens cannot be rolled back on this model)"
        return f"{mode} (--speculative off turns it off)"

    def _disk_line(self) -> str:
        disk = self.engine.serving.disk if self.engine.loaded else None
        if disk is None or not disk.on:
            return ", no disk tier"
        return (f", disk tier of {disk.max_bytes / GiB:.2f} GiB at {disk.folder} ({disk.files} entries, "
                f"{disk.nbytes / GiB:.2f} GiB)")


def _held_tokens(tokens: dict[str, int]) -> str:
    """` = 356k tokens in float32 (int8: 1.3M, ...)`: what the budget holds in the storage chosen (the first)
    and in the others --kv-cache-dtype offers; empty where the backend says nothing of them."""
    if not tokens:
        return ""
    (own, n), *others = tokens.items()
    rest = ", ".join(f"{name}: {_count(m)}" for name, m in others)
    return f" = {_count(n)} tokens in {own}" + (f" ({rest})" if rest else "")


def _count(n: int) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1_000_000 else f"{n / 1e3:.3g}k" if n >= 1000 else str(n)


def open_kv_events(config: ServerConfig):
    """The KV event publisher --kv-events-endpoint asks for (pyzmq, imported only then), else None."""
    if config.kv_events_endpoint is None:
        return None
    from kvfork.server.watch.kv_events import KVEventPublisher, KVEvents, refusal

    keyed = bool(key_tenants(config.api_key, config.api_keys_file))
    refused = refusal(config.kv_events_endpoint, keyed, config.kv_events_public, config.kv_events_hashes_only)
    if refused is not None:
        raise OSError(refused)

    replay = config.kv_events_replay_endpoint
    if replay is None and config.kv_events_endpoint.startswith("tcp://"):
        host, _, port = config.kv_events_endpoint.rpartition(":")
        replay = f"{host}:{int(port) + 1}" if int(port) else f"{host}:0"
    publisher = KVEventPublisher(config.kv_events_endpoint, replay, wire_format=config.kv_events_format)
    return KVEvents(publisher, config.kv_events_block_size, config.kv_events_hashes_only)


def pick_backend(name: str) -> tuple[str, Backend]:
    """`auto` prefers the machine's default (torch off Apple Silicon) and falls back to MLX where
    that backend is not installed."""
    if name == "auto":
        try:
            return default_backend(), create_backend("auto")
        except ImportError:
            name = "mlx"
    return name, create_backend(name)


def _announce_kv_events(pub: Any, config: ServerConfig) -> None:
    """Where KV events are published, and who can read them."""
    from kvfork.server.watch.kv_events import readers

    print(f"kvfork: KV events on {pub.endpoint} (replay: {pub.replay_endpoint}), blocks of "
          f"{config.kv_events_block_size} tokens: {readers(pub.endpoint, config.kv_events_hashes_only)}", flush=True)


def _load_failure(exc: BaseException | None, model: str) -> int | None:
    """The exit code of a load that raised `exc`, its one line printed; None where it loaded."""
    if isinstance(exc, (KVStorageRefused, BackendRefused)):  # a --kv-cache-dtype or --backend this model cannot take
        print(f"kvfork serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if exc is not None:  # a model the backend or the tokenizer cannot read
        print(f"kvfork: loading {model} failed: {exc}")
        return 1
    return None


async def run(config: ServerConfig, engine_config: EngineConfig, model: str,
              leader: LockstepBackend | None = None, fetch: Fetch | None = None,
              specs: list[ModelSpec] | None = None) -> int:
    """Serve until a signal. `leader`: rank 0's backend of a model split over ranks (server/launch/distributed.py);
    `fetch`: the model is downloaded first (model_source.py); `specs`: several models (server/pool/)."""
    if leader is not None:
        backend_name, backend = f"{config.backend}, rank 0 of {leader.channel.size}, pid {os.getpid()}", leader
    else:
        try:
            backend_name, backend = pick_backend(config.backend)
        except ImportError as e:
            print(f"kvfork: the {config.backend} backend cannot load here: {e}")
            return 1
    try:
        daemon: Daemon | PoolDaemon = Daemon(config, engine_config, model, backend, fetch) if specs is None else \
            PoolDaemon(config, engine_config, specs, backend_name, lambda: create_backend(backend_name))
    except OSError as e:  # the KV event sockets
        print(f"kvfork: KV events: {e}")
        return 1
    if leader is not None:  # a stalled rank fails the engine from the watchdog's thread
        loop = asyncio.get_running_loop()
        leader.on_fault = lambda reason: loop.call_soon_threadsafe(daemon.engine.fail, reason)  # type: ignore[union-attr]
    try:
        await daemon.listen()
    except OSError as e:
        print(f"kvfork: cannot listen on {config.host}:{config.port}: {e.strerror or e}")
        return 1
    print(f"kvfork: listening on {daemon.url} (loading {model} on {backend_name})", flush=True)
    if daemon.kv_events is not None:
        _announce_kv_events(daemon.kv_events.publisher, config)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal stops at once
            loop.remove_signal_handler(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    loading, stopping = asyncio.create_task(daemon.load()), asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            failed = _load_failure(loading.exception(), model)
            if failed is not None:
                return failed
            if not daemon.memory_fits():
                return 2
            print(daemon.loaded_line(), flush=True)
            await stopping
        print("kvfork: shutting down", flush=True)
        return 0
    finally:
        stopping.cancel()
        loading.cancel()
        await daemon.close()
        if leader is not None and not daemon.engine.runner_alive:  # type: ignore[union-attr]  # the other ranks leave
            await asyncio.to_thread(leader.stop, "rank 0 shut down")
