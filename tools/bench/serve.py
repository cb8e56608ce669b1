"""Starting a server as a child process on a free port, and reading its /metrics.

Used for kvfork's own daemon and for the peers. The child's output goes to a
log file next to the results, so a server that fails to start says why.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def exit_on_sigterm() -> None:
    """Turn SIGTERM (timeout, CI) into SystemExit, so `with ServerProcess` stops the servers we started."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(RuntimeError):
    pass


@dataclass
class ServerProcess:
    name: str
    argv: list[str]  # may contain "{port}", filled in at start
    log_path: Path
    ready_path: str = "/health"
    ready_timeout_s: float = 600.0  # a first run may fetch and convert the model
    env: dict[str, str] = field(default_factory=dict)
    scratch: Path | None = None  # a folder of the server's own, removed once it has stopped
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        self.port = free_port()
        argv = [a.replace("{port}", str(self.port)) for a in self.argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True
        )
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited with code {self.proc.returncode}; last lines:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base_url + self.ready_path, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerFailed(f"{self.name} was not ready after {self.ready_timeout_s:.0f}s; last lines:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        self._stop()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # The server runs in its own process group: stop it and whatever it spawned.
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


Metrics = dict[str, float]  # 'name{labels}' -> value


def parse_metrics(text: str) -> Metrics:
    out: Metrics = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def scrape_metrics(base_url: str) -> Metrics:
    """The server's Prometheus counters; empty for a server without /metrics."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            return parse_metrics(resp.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return {}


def metric_total(metrics: Metrics, name: str, **labels: str) -> float | None:
    """Sum of `name` over label sets that carry `labels`; None when the server has no such metric."""
    found = None
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name or any(f'{k}="{v}"' not in rest for k, v in labels.items()):
            continue
        found = (found or 0.0) + value
    return found
