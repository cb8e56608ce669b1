"""`kvfork bench cluster`: routing policies over replicas, side by side, and the gateway's own overhead.

For each contender in turn, on this machine: start it, replay the same workloads
(the agent preset's shape: sessions
resending a shared system prompt and their growing history, a sub-agent forked mid-session), stop it. Contenders:
  sticky     `kvfork cluster` (smg cache_aware, sticky sessions on each call's session as x-smg-routing-key,
             a new session pinned to the replica with the fewest)
  delegate   the same, a new session pinned where cache_aware sends its first call
  rr         `kvfork cluster --policy round_robin --no-sticky-sessions`
  single     one `kvfork serve` with the whole KV budget
Then the gateway's overhead: sequential short calls on an idle replica, through
smg and direct, interleaved. Prints one markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from kvfork.server.generate.isolated import module_command
from kvfork.tools.bench.client import Record, Target, request_body, stream_chat
from kvfork.tools.bench.runner import replay
from kvfork.tools.bench.serve import ServerProcess, exit_on_sigterm, free_port
from kvfork.tools.bench.stats import percentile, summarize
from kvfork.tools.bench.workload import Options, agentic

CONTENDERS = ("sticky", "delegate", "rr", "single")


def _start_cluster(port: int, policy_args: list[str], serve_args: list[str], log: Path) -> subprocess.Popen:
    argv = [*module_command("kvfork.server.cli"), "cluster", "--replicas", "2", "--port", str(port), *policy_args,
            *serve_args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:  # the child writes through its own copy of the descriptor
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvfork cluster exited ({proc.returncode}): see {log}")
        if f"gateway: http://127.0.0.1:{port}\n" in log.read_text(errors="replace"):
            return proc
        time.sleep(0.5)
    _stop(proc)
    raise RuntimeError(f"kvfork cluster not ready: see {log}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _free_run(span: int) -> int:
    for _ in range(50):
        base = free_port()
        if base + span < 65535:
            return base
    raise RuntimeError("no free ports")


async def _overhead(gateway: str, direct: str, model: str, calls: int) -> dict:
    """TTFT of one short streamed call at a time, alternating gateway and direct, on an idle replica."""
    through, straight = [], []
    messages = [{"role": "user", "content": "Say hello."}]
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        for i in range(calls):
            for url, out in ((gateway, through), (direct, straight)) if i % 2 == 0 else ((direct, straight),
                                                                                         (gateway, through)):
                rec = await stream_chat(http, Target(url, model), Record(f"o{i}", "overhead", "overhead"),
                                        request_body(messages, 1, model), t0)
                if rec.ok and rec.ttft_s is not None:
                    out.append(rec.ttft_s)
    return {"through_p50": percentile(through, 50), "direct_p50": percentile(straight, 50),
            "through_p95": percentile(through, 95), "direct_p95": percentile(straight, 95), "calls": calls}


def table(passes: list) -> str:
    """Prefill tokens and hit rate are what each routing keeps; times move with the machine's load."""
    rows = ["| contender | requests | failed | prompt tokens | prefill tokens | hit rate | TTFT p50 s | TTFT p95 s "
            "| wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for label, s in passes:
        hit = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        rows.append(f"| {label} | {s.requests} | {s.failed} | {s.prompt_tokens:,} | {s.prefill_tokens:,} | {hit:.1%} "
                    f"| {s.ttft_p50:.2f} | {s.ttft_p95:.2f} | {s.wall_s:.1f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfork bench cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the default model)")
    ap.add_argument("--kv-budget-bytes", type=int, default=2 * 1024**3, help="the total budget, split in a cluster")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"from {', '.join(CONTENDERS)}")
    ap.add_argument("--sessions", type=int, default=2, help="agent sessions (the agent preset's roots)")
    ap.add_argument("--calls", type=int, default=24, help="calls over all sessions, sub-agents included")
    ap.add_argument("--root-concurrency", type=int, default=2, help="sessions at once")
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--overhead-calls", type=int, default=20, help="0: skip the gateway overhead")
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for every daemon")
    ap.add_argument("--out", default=f"out/bench/{time.strftime('%Y%m%d-%H%M%S')}-cluster")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a timeout or Ctrl-C stops the servers this started
    from kvfork.tools.bench.paired import default_model

    model = args.model or default_model()
    name = Path(model).name
    out = Path(args.out)
    opts = Options(root_concurrency=args.root_concurrency, prefix_tokens=args.prefix_tokens,
                   max_tokens=(args.max_tokens, args.max_tokens))
    wl = agentic(f"agent-{args.sessions}x", opts, sessions=args.sessions, total_calls=args.calls)
    serve_args = ["--model", model, "--kv-budget-bytes", str(args.kv_budget_bytes), *args.server_arg]
    passes, overhead = [], None
    for contender in [c.strip() for c in args.contenders.split(",") if c.strip()]:
        started = time.strftime("%H:%M:%S")
        if contender == "single":
            srv = ServerProcess("single", module_command("kvfork.server", *serve_args, "--port", "{port}"),
                                out / "single.log", env={"KVFORK_HOME": str(out / "home-single")})
            with srv:
                result = asyncio.run(replay(wl, Target(srv.base_url, name), label=contender))
        else:
            port = _free_run(5)
            policy = {"sticky": [], "delegate": ["--assignment", "delegate"],
                      "rr": ["--policy", "round_robin", "--no-sticky-sessions"]}[contender]
            env_home = out / f"home-{contender}"
            os.environ["KVFORK_HOME"] = str(env_home)  # each contender's disk tiers start empty
            proc = _start_cluster(port, policy, serve_args, out / f"{contender}.log")
            try:
                gateway = f"http://127.0.0.1:{port}"
                target = Target(gateway, name, routing_key=contender != "rr")
                result = asyncio.run(replay(wl, target, label=contender))
                if contender == "sticky" and args.overhead_calls:
                    overhead = asyncio.run(_overhead(gateway, f"http://127.0.0.1:{port + 1}", name,
                                                     args.overhead_calls))
            finally:
                _stop(proc)
        passes.append((contender, summarize(result.records, result.wall_s)))
        errors = sorted({r.error for r in result.records if r.error})
        print(f"{contender}: started {started}, {result.wall_s:.1f} s" + "".join(f"\n  error: {e}" for e in errors),
              file=sys.stderr)
    md = table(passes)
    if overhead:
        md += ("\n**gateway overhead** (TTFT of one short call on an idle replica, "
               f"{overhead['calls']} each, interleaved)\n\n| | p50 | p95 |\n|---|---|---|\n"
               f"| through smg | {overhead['through_p50']:.4f} s | {overhead['through_p95']:.4f} s |\n"
               f"| direct | {overhead['direct_p50']:.4f} s | {overhead['direct_p95']:.4f} s |\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(md)
    print(md)
    return 0
