"""`kvfork cluster`: N replicas of one model on this machine, with smg in front.

    kvfork cluster --replicas 2 --port 8080 [serve flags for every replica ...]

Each replica is a `kvfork serve` of its own on 127.0.0.1 (ports P+1 .. P+N): the
same model folder, an equal share of one KV budget (--kv-budget-bytes, or the
daemon's default, split N ways), and a disk tier of its own
($KVFORK_HOME/cluster/replica-I, kept across restarts). smg, the SGLang
project's gateway, listens on 127.0.0.1:P and routes between them with its
cache_aware policy and sticky sessions on the `x-smg-routing-key` header: a new
conversation goes to the replica holding the fewest (smg's min_group), and its
prefixes stay warm there. kvfork adds no routing of
its own: smg decides, from its view of each replica's prefixes and their
/v1/loads.

The command prints `replica I: URL` as each replica becomes ready, then
`gateway: URL` once smg reports every replica healthy. A replica that exits is
started again (its disk tier brings its prefixes back); smg's health checks
take it out meanwhile and back in after. Ctrl-C (or SIGTERM) stops them all:
each replica gets one SIGTERM, so it finishes in-flight requests and spills its
prefix cache to its disk tier (`--shutdown-grace`).

smg is optional (`pip install '.[cluster]'` from a checkout, or `pip install smg`) and never imported here: it runs
in a process of its own, in Python's isolated mode. Its control plane (worker
registration and removal, /workers, /get_loads) is closed: the cluster makes a key
at each start (`--control-plane-api-keys`, role admin), hands it to smg through a
pipe, never a command line (smg's entry point is called in-process with the argv
built there: `SMG_LAUNCH`), and keeps it 0600 in $KVFORK_HOME/cluster/control-plane-key
for the operator. Several machines: see the README (replicas started by hand,
`smg launch --worker-urls ...` pointed at them).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import aiohttp

from kvfork.backends.device_memory import weights_on_disk
from kvfork.backends.home import kvfork_home
from kvfork.server.engine.policy.memory_plan import shared_host_plan
from kvfork.server.generate.isolated import module_command
from kvfork.server.watch.kv_events import loopback

HOST = "127.0.0.1"  # replicas and the gateway: loopback only (several machines: the README's recipe)
ASSIGNMENTS = ("min_group", "min_load", "random", "delegate")
POLICIES = ("cache_aware", "round_robin", "prefix_hash", "consistent_hashing", "power_of_two", "least_load",
            "random")
INSTALL_HINT = "smg is not installed: pip install smg (from a checkout's root: pip install '.[cluster]')"
READY_TIMEOUT_S = 600.0  # a first run may fetch and convert the default model
STOP_TIMEOUT_S = 30.0  # after SIGTERM: the replicas' --shutdown-grace (10 s) and their disk spills
QUICK_EXIT_S = 30.0  # a replica that exits this soon after starting, three times running, stays down
POLL_S = 0.25
CONTROL_KEY_FILE = "control-plane-key"  # in $KVFORK_HOME/cluster, 0600: smg's control-plane key of this run
# smg's command line: its argv (the control-plane key among it) arrives as one JSON line on stdin, and its
# entry point runs in this process, so /proc/PID/cmdline never holds the key
SMG_LAUNCH = "import json, sys; argv = json.loads(sys.stdin.readline()); from smg.cli import main; main(argv)"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> Parser:
    p = Parser(prog="kvfork cluster", description="N replicas of one model behind smg (cache_aware, sticky "
               "sessions), all on 127.0.0.1. Flags not listed here go to every replica's `kvfork serve`.")
    p.add_argument("--replicas", type=int, default=2, help="replicas to start (default: 2)")
    p.add_argument("--port", type=int, default=8080, help="the gateway's port; replicas take the next N ports "
                   "(default: 8080)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="smg's routing policy "
                   "(default: cache_aware)")
    p.add_argument("--sticky-sessions", action=argparse.BooleanOptionalAction, default=True,
                   help="pin every request carrying one x-smg-routing-key to one replica (default: on)")
    p.add_argument("--assignment", choices=ASSIGNMENTS, default="min_group",
                   help="where smg pins a routing key it has not seen: min_group (the replica with the fewest keys, "
                   "so conversations spread while each stays warm where it began), min_load, random, or delegate "
                   "(wherever the policy sends its first request: cache_aware sends every conversation sharing "
                   "a system prompt to one replica) (default: min_group)")
    p.add_argument("--health-check-interval", type=int, default=2, help="seconds between smg's health checks "
                   "of each replica (default: 2)")
    p.add_argument("--gateway-metrics-port", type=int, default=None, help="smg's Prometheus port on 127.0.0.1 "
                   "(default: the port after the last replica's)")
    return p


@dataclass
class Plan:
    """What the cluster runs: every command line, decided before anything starts."""

    port: int
    metrics_port: int
    replicas: list[list[str]]  # each replica's command line
    homes: list[Path]  # each replica's KVFORK_HOME (its disk tier is under it)
    gateway: list[str]  # smg's arguments (`launch ...`), less the control-plane key
    control_key: str  # smg's control-plane key (admin), made for this run
    # Each replica's share of the cores: N replicas of torch each taking every core thrash one machine
    # (2 replicas on 2 cores took 15x one replica's wall time). An OMP_NUM_THREADS of the user's wins.
    replica_env: dict[str, str] = field(default_factory=dict)

    def replica_url(self, index: int) -> str:
        return f"http://{HOST}:{self.port + 1 + index}"

    @property
    def gateway_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def gateway_argv(self) -> list[str]:
        """smg's whole argv, the key included: for its stdin, never a command line."""
        return [*self.gateway, "--control-plane-api-keys", f"kvfork:kvfork cluster:admin:{self.control_key}"]


def plan(argv: list[str]) -> Plan:
    """Parse and check everything up front: a bad flag exits 2 before any process starts."""
    p = parser()
    args, serve_args = p.parse_known_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    if args.health_check_interval < 1:
        p.error("--health-check-interval must be >= 1")
    metrics_port = args.gateway_metrics_port or args.port + args.replicas + 1
    ports = [args.port, *range(args.port + 1, args.port + 1 + args.replicas), metrics_port]
    if min(ports) < 1 or max(ports) > 65535 or len(set(ports)) != len(ports):
        p.error(f"ports {min(ports)}..{max(ports)} do not fit (each replica takes the port after the gateway's)")
    from kvfork.server.cli import announce, read_settings, serve_parser  # the replicas' flags, checked as serve checks them

    serve = serve_parser()
    serve.prog = "kvfork cluster (replica flags)"
    _, config, engine_config, found = read_settings(serve, serve_args)
    announce(found)
    if config.host != HOST:
        p.error(f"--host is the cluster's to set: everything listens on {HOST} (several machines: the README)")
    if len(config.model) > 1 or config.models_dir:
        p.error("each replica serves one model: several models are served by one `kvfork serve` (docs/cluster.md)")
    model = config.model[0] if config.model else str(_default_model())
    share = engine_config.kv_budget_bytes // args.replicas if engine_config.kv_budget_bytes else \
        shared_host_plan(weights_on_disk(model), args.replicas).kv_budget_bytes
    # Keys reach the replicas in their environment, never on a command line every local user can read.
    own = ("--model", "--kv-budget-bytes", "--kv-events-endpoint", "--kv-events-replay-endpoint", "--api-key",
           "--metrics-key")
    base = [*module_command("kvfork.server"), *_without(serve_args, *own),
            "--model", model, "--kv-budget-bytes", str(share), "--host", HOST]
    replicas = [[*base, "--port", str(args.port + 1 + i), *_kv_events(config.kv_events_endpoint, i, p)]
                for i in range(args.replicas)]
    homes = [kvfork_home() / "cluster" / f"replica-{i + 1}" for i in range(args.replicas)]
    gateway = ["launch", "--host", HOST, "--port", str(args.port),
               "--worker-urls", *(f"http://{HOST}:{args.port + 1 + i}" for i in range(args.replicas)),
               "--policy", args.policy, "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
               "--health-check-interval-secs", str(args.health_check_interval),
               "--health-failure-threshold", "2", "--health-success-threshold", "1",
               "--worker-startup-check-interval", "1", "--load-monitor-interval", "2",
               # the replicas finish in-flight requests within their own --shutdown-grace; smg need not wait longer
               "--shutdown-grace-period-secs", "15",
               # cache_aware works on request text over HTTP; no tokenizer to fetch from a hub
               "--disable-tokenizer-autoload"]
    if args.sticky_sessions:
        gateway += ["--sticky-sessions", "--assignment-mode", args.assignment]
    env = {} if "OMP_NUM_THREADS" in os.environ else {
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.replicas))}
    if config.api_key:
        env["KVFORK_API_KEY"] = ",".join(config.api_key)
    if config.metrics_key:
        env["KVFORK_METRICS_KEY"] = config.metrics_key
    return Plan(args.port, metrics_port, replicas, homes, gateway, secrets.token_urlsafe(32), env)


def _kv_events(endpoint: str | None, index: int, p: Parser) -> list[str]:
    """Replica `index`'s KV event sockets: the endpoint's port + 2 * index, its replay on the next port."""
    if endpoint is None:
        return []
    host, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not int(port):
        p.error("--kv-events-endpoint: a cluster needs tcp://HOST:PORT (each replica takes PORT + 2i and the next)")
    if not loopback(endpoint):  # as --host: the events carry prompts; several machines: the README
        p.error(f"--kv-events-endpoint is loopback in a cluster (tcp://{HOST}:PORT): events carry token ids, and "
                "everything here listens on loopback (several machines: the README)")
    first = int(port) + 2 * index
    return ["--kv-events-endpoint", f"{host}:{first}", "--kv-events-replay-endpoint", f"{host}:{first + 1}"]


def _without(argv: list[str], *flags: str) -> list[str]:
    """`argv` less the given flags and their values (`--flag V` or `--flag=V`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out


def _default_model() -> Path:
    from kvfork.backends.default_model import FetchError, ensure_default_model

    try:
        return ensure_default_model()
    except FetchError as e:
        sys.exit(f"kvfork cluster: the default model is not available: {e} (or pass --model FOLDER)")


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    pump: asyncio.Task | None = None
    log: Path | None = None  # where its output goes; None: to ours, each line under its name
    cwd: Path | None = None  # where it runs (smg writes its smg.pid there)
    stdin_data: bytes | None = None  # written to its stdin, which is then closed (None: no stdin)

    async def start(self) -> None:
        # A session of its own: a Ctrl-C in the terminal reaches the cluster alone, which then stops each
        # child with one SIGTERM (a second signal would make a replica skip its grace and its disk spill).
        out = open(self.log, "wb") if self.log is not None else asyncio.subprocess.PIPE
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdout=out, stderr=asyncio.subprocess.STDOUT, env={**os.environ, **self.env},
                cwd=self.cwd, start_new_session=True,
                stdin=asyncio.subprocess.PIPE if self.stdin_data is not None else asyncio.subprocess.DEVNULL)
        finally:
            if self.log is not None:
                out.close()
        if self.stdin_data is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(self.stdin_data)
            await self.proc.stdin.drain()
            self.proc.stdin.close()
        self.started_at = time.monotonic()
        if self.log is None:
            self.pump = asyncio.create_task(self._forward())

    async def _forward(self) -> None:
        """The child's output, each line under its name."""
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            print(f"[{self.name}] {line.decode(errors='replace').rstrip()}", flush=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self.pump is not None:
            await asyncio.gather(self.pump, return_exceptions=True)


async def _get_json(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None):
    try:
        async with http.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def write_private(path: Path, text: str) -> None:
    """`text` in a 0600 file, replaced whole (a temporary file renamed over it; a link there is replaced, never
    followed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


async def _until(check, child: Child, what: str, stop: asyncio.Event) -> None:
    """Poll `check` until it holds; a signal (`stop`) ends the wait too."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (await check()) and not stop.is_set():
        if not child.running:
            raise RuntimeError(f"{child.name} exited (code {child.proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name}: no {what} after {READY_TIMEOUT_S:.0f} s")
        await asyncio.sleep(POLL_S)


async def run(p: Plan) -> int:
    replicas = [Child(f"replica {i + 1}", argv, {**p.replica_env, "KVFORK_HOME": str(home)})
                for i, (argv, home) in enumerate(zip(p.replicas, p.homes))]
    # smg's own log (a banner, then a line per request at info) goes to a file beside the replicas' folders
    folder = kvfork_home() / "cluster"
    gateway = Child("gateway", [sys.executable, "-I", "-c", SMG_LAUNCH], log=folder / "gateway.log", cwd=folder,
                    stdin_data=json.dumps(p.gateway_argv()).encode() + b"\n")
    folder.mkdir(parents=True, exist_ok=True)
    write_private(folder / CONTROL_KEY_FILE, p.control_key + "\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with aiohttp.ClientSession() as http:
            return await _start_and_supervise(p, replicas, gateway, stop, http)
    except RuntimeError as e:
        print(f"kvfork cluster: {e}", file=sys.stderr, flush=True)
        if gateway.log is not None and not gateway.running:
            print(f"kvfork cluster: the gateway's log is {gateway.log}", file=sys.stderr, flush=True)
        return 1
    finally:  # the gateway first: it stops taking requests while the replicas finish theirs
        await gateway.stop()
        await asyncio.gather(*(child.stop() for child in replicas))


async def _start_and_supervise(p: Plan, replicas: list[Child], gateway: Child, stop: asyncio.Event,
                               http: aiohttp.ClientSession) -> int:
    async def ready(i: int) -> None:
        await _until(lambda: _get_json(http, p.replica_url(i) + "/health"), replicas[i], "a healthy /health", stop)
        if not stop.is_set():
            print(f"replica {i + 1}: {p.replica_url(i)}", flush=True)

    async def all_healthy() -> bool:
        workers = await _get_json(http, p.gateway_url + "/workers", {"Authorization": f"Bearer {p.control_key}"})
        return len([w for w in (workers or {}).get("workers", []) if w.get("is_healthy")]) == len(replicas)

    for home, child in zip(p.homes, replicas):
        home.mkdir(parents=True, exist_ok=True)
        await child.start()
    await asyncio.gather(*(ready(i) for i in range(len(replicas))))
    if not stop.is_set():
        await gateway.start()
        await _until(all_healthy, gateway, "every replica healthy at the gateway", stop)
    if stop.is_set():
        return 130
    print(f"gateway: {p.gateway_url}", flush=True)
    print(f"kvfork cluster: gateway metrics at http://{HOST}:{p.metrics_port}/metrics, its log in {gateway.log}, "
          f"its control-plane key in {gateway.cwd / CONTROL_KEY_FILE}; Ctrl-C stops everything", flush=True)
    return await _supervise(replicas, gateway, stop)


async def _supervise(replicas: list[Child], gateway: Child, stop: asyncio.Event) -> int:
    """Until a signal: a replica that exits starts again (smg takes it out, then back in on its own
    health checks); one that keeps dying right after it starts stays down. The gateway exiting ends it all."""
    while not stop.is_set():
        if not gateway.running:
            print(f"kvfork cluster: the gateway exited (code {gateway.proc.returncode})", file=sys.stderr)
            return 1
        for i, child in enumerate(replicas):
            if child.running or child.proc is None:
                continue
            quick = time.monotonic() - child.started_at < QUICK_EXIT_S
            child.quick_exits = child.quick_exits + 1 if quick else 0
            if child.quick_exits >= 3:
                print(f"kvfork cluster: {child.name} exited three times within {QUICK_EXIT_S:.0f} s of starting; "
                      "left down", file=sys.stderr, flush=True)
                child.proc = None
                continue
            print(f"kvfork cluster: {child.name} exited (code {child.proc.returncode}); starting it again",
                  flush=True)
            await child.start()
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass
    print("kvfork cluster: stopping", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if importlib.util.find_spec("smg") is None and not {"-h", "--help"} & set(argv):
        print(f"kvfork cluster: {INSTALL_HINT}", file=sys.stderr)  # before the default model is fetched
        return 1
    p = plan(argv)
    taken = [port for port in (p.port, *(p.port + 1 + i for i in range(len(p.replicas))), p.metrics_port)
             if _port_taken(port)]
    if taken:
        print(f"kvfork cluster: port(s) {', '.join(map(str, taken))} already in use (pick another --port)",
              file=sys.stderr)
        return 1
    return asyncio.run(run(p))
