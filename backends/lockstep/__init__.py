"""One model across ranks, in lockstep: tensor parallelism on every rank, one engine on rank 0.

    ranks = join("torch")          # torchrun / mlx.launch (or their environment, set by hand)
    if ranks.rank == 0:
        backend = LockstepBackend(ranks.backend, ranks.channel, timeout)   # leader.py: to the engine
    else:
        Follower(ranks.backend, ranks.channel).run()                        # follower.py

Each rank's backend holds its shard of the model (backends/torch/parallel.py; mlx-lm's own
`Model.shard` for MLX) and of every session's KV state. Rank 0's engine decides everything; every
backend effect its backend runs (backends/effects.py, the values of the engine's step plan) goes to
the other ranks (wire.py) over the same collective library (channel.py), and each runs it through
its own Executor. Pipeline parallelism is not here (docs/distributed.md says what it would take).
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfork.backends.base import Backend
from kvfork.backends.lockstep.channel import Channel, MLXChannel, TorchChannel

# The plan channel waits as long as rank 0 stays idle: a lost peer still ends it at once (its
# connection closes), and a stalled one is rank 0's watchdog's to find (leader.py).
IDLE_LIMIT = datetime.timedelta(days=3650)


class JoinError(Exception):
    """The process is not one rank of a group: no launcher and no environment saying which."""


@dataclass
class Ranks:
    rank: int
    size: int
    channel: Channel
    backend: Backend  # this rank's shard of the model, not loaded yet
    framework: str
    local: int = 1  # ranks on this rank's machine (they share its memory)

    def close(self) -> None:
        """Leave the group once every rank has stopped (a Stop went round)."""
        if self.framework == "torch":
            import torch.distributed as dist

            dist.destroy_process_group()


def join(backend: str) -> Ranks:
    """This process's rank of the group its launcher started, with the backend that holds its shard."""
    ranks = _join_mlx() if backend == "mlx" else _join_torch()
    if ranks.size < 2:
        raise JoinError(f"--distributed found a group of {ranks.size} rank; start 2 or more")
    return ranks


def _join_torch() -> Ranks:
    import torch
    import torch.distributed as dist

    from kvfork.backends.torch.backend import TorchBackend, default_device
    from kvfork.backends.torch.parallel import Shards

    device = default_device()
    if device.type == "cuda" and device.index is None:  # one GPU per rank on a machine: torchrun's LOCAL_RANK
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    except (ValueError, RuntimeError) as exc:
        raise JoinError(f"start every rank with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                        f"by hand): {exc}") from exc
    control: Any = dist.new_group(backend="gloo", timeout=IDLE_LIMIT)
    rank, size = dist.get_rank(), dist.get_world_size()
    return Ranks(rank, size, TorchChannel(control), TorchBackend(str(device), Shards(rank, size)), "torch",
                 int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _join_mlx() -> Ranks:
    import mlx.core as mx

    from kvfork.backends.mlx.backend import MLXBackend

    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as exc:
        raise JoinError(f"start every rank with mlx.launch (or set MLX_RANK and MLX_HOSTFILE by hand): {exc}") from exc
    rank = group.rank()
    return Ranks(rank, group.size(), MLXChannel(group), MLXBackend(group), "mlx", _ring_neighbours(rank))


def _ring_neighbours(rank: int) -> int:
    """Ranks of the ring's hostfile (MLX_HOSTFILE: one list of "ip:port" per rank) on this rank's IP."""
    try:
        hosts = json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())
        ip = lambda entries: entries[0].rsplit(":", 1)[0]  # noqa: E731
        return sum(1 for entries in hosts if ip(entries) == ip(hosts[rank]))
    except (KeyError, OSError, ValueError, IndexError, TypeError, AttributeError):
        return 1  # another backend (JACCL, MPI) or no file: counted as alone
