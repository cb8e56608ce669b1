"""Two ranks on this machine, for the 2-rank tests: under each backend's launcher (torchrun,
mlx.launch) or by hand (the launchers' environment, set here), on free loopback ports.

Every rank runs with one thread (two ranks share the machine's cores with the rest of the suite),
torch ranks without the OpenBLAS preload the MLX ones need. Waits are bounded polls, never timings.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from tolerance import Model, bound

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DISTRIBUTED_BACKENDS = ("torch", "mlx")
KV_BUDGET = str(256 * 1024 * 1024)  # per rank, as http_daemon's TEST_ENGINE gives one process
# How far a 2-rank run's float32 logits may be from one process's: tests/tolerance.py's bound (kind
# RANKS). Tensor parallelism changes only the order of sums (each all_reduce adds two partial sums of
# K/2 terms where one process adds K in one run), which that model covers. Over HTTP only logprobs come
# back, not the logits' scale: the tiny models' logits stay within LOGIT_SCALE (test_distributed_backends
# checks it on every scenario), and a logprob moves by its logit's error and the log-sum-exp's.
LOGIT_SCALE = 128.0  # the tiny models reach about 70 (gemma3)


def logprob_bound(folder: str | Path) -> float:
    """How far a 2-rank reply's logprobs may be from one process's, at any context the model takes."""
    config = json.loads((Path(folder) / "config.json").read_text())
    context = config.get("text_config", config).get("max_position_embeddings", 4096)
    return 2 * bound(LOGIT_SCALE, Model.of(folder).reductions(context))


def free_ports(n: int) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1 (the ring backend takes one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n < 65536 and all(_free(first + i) for i in range(n)):
            return first
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


METRICS_KEY = "ranks-metrics-key"  # /health says why the runner stopped only to its holder


def rank_env(backend: str, home: Path) -> dict[str, str]:
    # KVFORK_DEVICE=cuda (tools/gpu_check.sh) puts rank r on GPU r, over NCCL; the CPU (gloo) otherwise.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", KVFORK_HOME=str(home),
               PYTHONUNBUFFERED="1", KVFORK_DEVICE=os.environ.get("KVFORK_DEVICE", "cpu"),
               KVFORK_METRICS_KEY=METRICS_KEY)
    if backend == "torch":
        env["LD_PRELOAD"] = ":".join(p for p in env.get("LD_PRELOAD", "").split(":") if "openblas" not in p)
    return env


def launched(backend: str, command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Both ranks of `command` (python arguments) under the backend's launcher."""
    port = free_ports(2)
    if backend == "torch":
        argv = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                str(port), *_torchrun_target(command)]
    else:
        argv = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "--starting-port",
                str(port), "--", sys.executable, *command]
    with log.open("w") as out:  # the child writes through its own copy of the descriptor
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _torchrun_target(command: list[str]) -> list[str]:
    return ["-m", command[1], *command[2:]] if command[0] == "-m" else command


def by_hand(backend: str, command: list[str], env: dict[str, str], logs: Path) -> list[subprocess.Popen]:
    """Rank 0 and rank 1 of `command`, started without a launcher: the environment says who is who."""
    port = free_ports(2)
    procs = []
    for rank in range(2):
        own = dict(env)
        if backend == "torch":
            own.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        else:
            hosts = logs / "hosts.json"
            hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
            own.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hosts))
        with (logs / f"rank{rank}.log").open("w") as out:
            procs.append(subprocess.Popen([sys.executable, *command], cwd=REPO, env=own, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait_exit(proc: subprocess.Popen, limit_s: float) -> int:
    try:
        return proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        raise


def stop_group(proc: subprocess.Popen) -> None:
    """Kill a launched command and everything it started (its own process group), whether or not the
    command itself has left: a launcher that dies leaves its ranks running."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def poll(check: Callable[[], object], what: str, limit_s: float = 240.0, every: float = 0.25) -> object:
    """`check()` until it returns something true; a bounded wait, not a timing assertion."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"gave up waiting for {what} after {limit_s:.0f} s")


def log_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
