"""`kvfork serve --distributed`: the same command on every rank, started by a launcher.

    mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -- kvfork serve --distributed --backend mlx
    torchrun --nproc-per-node 2 $(which kvfork) serve --distributed --backend torch

Rank 0 serves HTTP and runs the engine on a LockstepBackend (backends/lockstep); every other rank
follows its plans and serves nothing. Rank 0's flags bind: it sends the model, dtype and clone mode
to the others with the first plan.

How each rank ends:
- rank 0 on SIGINT/SIGTERM: the daemon's shutdown (in-flight requests get --shutdown-grace, then a
  clear error), then a Stop plan takes every other rank out;
- rank 0 when another rank is lost or stalls: its requests end with a 503 naming the rank, /health
  names it too, and it serves 503s until stopped (a launcher stops it: both mlx.launch and torchrun
  send SIGTERM once a rank exits);
- another rank on a Stop plan, or when rank 0 is gone (its collective fails); a first SIGINT or
  SIGTERM waits for rank 0's Stop (rank 0 is finishing its requests: torchrun forwards a SIGTERM to
  every rank, a terminal's Ctrl-C reaches every rank mlx.launch started), a second leaves at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import threading
from typing import Any

from kvfork.backends import default_backend
from kvfork.backends.device_memory import weights_on_disk
from kvfork.backends.lockstep import JoinError, Ranks, join
from kvfork.backends.lockstep.follower import Follower
from kvfork.backends.lockstep.leader import LockstepBackend
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.policy.memory_plan import shared_host_plan


def serve(config: ServerConfig, engine_config: EngineConfig, model: str) -> int:
    try:
        ranks = join(default_backend() if config.backend == "auto" else config.backend)
    except (JoinError, ImportError) as e:
        print(f"kvfork: --distributed: {e}", file=sys.stderr)
        return 1
    if ranks.rank != 0:
        return follow(ranks)
    from kvfork.server.launch.serve import run

    engine_config = shared_budget(engine_config, model, ranks)

    leader = LockstepBackend(ranks.backend, ranks.channel, config.rank_timeout)
    try:
        code = asyncio.run(run(config, engine_config, model, leader))
    except KeyboardInterrupt:
        code = 130
    return leave(ranks, code, healthy=leader.stopped)


def shared_budget(engine_config: EngineConfig, model: str, ranks: Ranks) -> EngineConfig:
    """Ranks on one machine's memory split what their parts of the weights leave (each rank holds as much KV
    as rank 0, whose budget the engine keeps). Ranks on GPUs have a device each: rank 0's own plan holds."""
    local = ranks.local
    on_gpu = str(getattr(ranks.backend, "device", "cpu")).startswith("cuda")
    if engine_config.kv_budget_bytes is not None or local <= 1 or on_gpu:
        return engine_config
    plan = shared_host_plan(weights_on_disk(model) // local, local)
    budget = plan.kv_budget_bytes
    print(f"kvfork: {local} ranks on this machine: a KV budget of {budget / 1024**3:.2f} GiB each ({plan.reason})",
          flush=True)
    return dataclasses.replace(engine_config, kv_budget_bytes=budget)


def follow(ranks: Ranks) -> int:
    print(f"kvfork: rank {ranks.rank} of {ranks.size} (pid {os.getpid()}): following rank 0's steps", flush=True)
    ended: dict[str, Any] = {}

    def body() -> None:
        try:
            ended["reason"] = Follower(ranks.backend, ranks.channel).run()
        except BaseException as exc:  # noqa: BLE001 - whatever ends the plans ends this rank
            ended["error"] = exc

    thread = threading.Thread(target=body, name="kvfork-follower", daemon=True)
    terms = []

    def on_signal(signum: int, frame: Any) -> None:
        terms.append(signum)
        name = signal.Signals(signum).name
        if len(terms) > 1:
            print(f"kvfork: rank {ranks.rank}: second signal ({name}), leaving now", flush=True)
            os._exit(128 + signum)
        print(f"kvfork: rank {ranks.rank}: {name}, leaving when rank 0 stops (again to leave now)", flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):  # a terminal's Ctrl-C reaches every rank under mlx.launch
        signal.signal(sig, on_signal)
    thread.start()
    while thread.is_alive():  # the main thread stays free to take signals; collectives block the other
        thread.join(0.5)
    if "error" in ended:  # rank 0 lost, or an effect this rank could not apply (a model it cannot load)
        error = ended["error"]
        print(f"kvfork: rank {ranks.rank}: leaving: {type(error).__name__}: {error}", flush=True)
        return leave(ranks, 1, healthy=False)
    print(f"kvfork: rank {ranks.rank}: stopped with rank 0 ({ended['reason']})", flush=True)
    return leave(ranks, 0, healthy=True)


def leave(ranks: Ranks, code: int, healthy: bool) -> int:
    """Leave the group; a group with a rank lost cannot be torn down cleanly (gloo aborts the process in
    its destructor), so the process leaves at once with its code, its output flushed."""
    if healthy:
        ranks.close()
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
