"""`kvfork bench` / `python -m kvfork.tools.bench`: replay, paired, peers.

  run     replay workloads against a server already running at --url
  paired  start kvfork once per reuse mode (default: off, then on) and compare
  peers   the same, plus mlx_lm.server and llama.cpp's server where available
  cluster routing policies over 2 replicas behind smg, against one replica (tools/bench/cluster.py)
  spec    speculative decoding off and on, same prompts, one run (tools/bench/spec.py)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from kvfork.tools.bench import paired, peers, report
from kvfork.tools.bench.client import Target
from kvfork.tools.bench.runner import replay
from kvfork.tools.bench.serve import exit_on_sigterm
from kvfork.tools.bench.stats import summarize
from kvfork.tools.bench.trace import TraceError, load
from kvfork.tools.bench.workload import PRESETS, Options, Workload, build


def _int_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 0 < lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI with 0 < LO <= HI, got {text!r}")
    return lo_i, hi_i


def _workload_args(p: argparse.ArgumentParser, default_presets: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--preset", default=default_presets,
                   help=f"comma-separated, run in order; from {', '.join(PRESETS)} (default: %(default)s)")
    g.add_argument("--trace", help="a JSONL trace to replay instead of presets")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--scale", type=float, default=0.03,
                   help="agentx-mini size: 1.0 = the C++ system's replay: 20 sessions, 684 calls (default: %(default)s)")
    g.add_argument("--n", type=int, default=4, help="burst/staggered: requests (default: %(default)s)")
    g.add_argument("--prefix-tokens", type=int, default=1500, help="shared prefix, about (default: %(default)s)")
    g.add_argument("--tail-tokens", type=int, default=40, help="burst/staggered: own last message")
    g.add_argument("--max-tokens", type=_int_range, default=(16, 32), help="per call, N or LO-HI (default 16-32)")
    g.add_argument("--think-s", type=float, default=0.0, help="think time between a session's calls")
    g.add_argument("--root-concurrency", type=int, default=1, help="agentx-mini: root sessions at once")
    g.add_argument("--stagger-delay", type=float, default=None,
                   help="staggered: send each request this long after the previous one was sent "
                        "(default: when the previous one streams its first token)")
    g.add_argument("--logprobs", action="store_true", help="ask for per-token logprobs (recorded per request)")
    g.add_argument("--stop-at-eos", action="store_true",
                   help="let calls end at EOS (default: ignore_eos, so every server generates max_tokens)")
    g.add_argument("--out", help="results folder (default: out/bench/<time>-<command>)")


def _workloads(args) -> list[Workload]:
    if args.trace:
        return [load(args.trace, args.seed)]
    opts = Options(seed=args.seed, scale=args.scale, n=args.n, prefix_tokens=args.prefix_tokens,
                   tail_tokens=args.tail_tokens, max_tokens=args.max_tokens, think_s=args.think_s,
                   root_concurrency=args.root_concurrency, stagger_delay_s=args.stagger_delay)
    return [build(name.strip(), opts) for name in args.preset.split(",") if name.strip()]


def _replay_opts(args) -> dict:
    return {"logprobs": args.logprobs, "ignore_eos": not args.stop_at_eos}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvfork bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="replay against a running server")
    run.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    run.add_argument("--model", help="the request's model field (default: left out)")
    run.add_argument("--api-key")
    run.add_argument("--routing-key", action="store_true",
                     help="send each call's session as x-smg-routing-key, for a gateway's sticky sessions (smg)")
    _workload_args(run, "agentx-mini")
    for name, default_peers in (("paired", ""), ("peers", "mlx,llama")):
        p = sub.add_parser(name, help="kvfork reuse modes side by side" + (", plus peers" if default_peers else ""))
        p.add_argument("--model", help="model folder (default: the default model, fetched if needed)")
        p.add_argument("--modes", default="off,on", help=f"kvfork modes, first is the base; from {', '.join(paired.MODES)}")
        p.add_argument("--threshold", type=int, default=None,
                       help="--active-prefix-reuse-min-tokens for reuse on (default: the daemon's)")
        p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                       help="extra daemon flag, repeatable (e.g. --server-arg=--backend=torch)")
        p.add_argument("--peers", default=default_peers, help="comma-separated from: mlx, llama")
        p.add_argument("--gguf", help="llama.cpp peer: the GGUF (default: the default model's)")
        _workload_args(p, "staggered,burst")
    return ap


def _out_dir(args) -> Path:
    return Path(args.out or f"out/bench/{time.strftime('%Y%m%d-%H%M%S')}-{args.command}")


def _run(args, workloads: list[Workload]) -> int:
    target = Target(args.url, args.model, args.api_key, routing_key=args.routing_key)
    passes = []
    for wl in workloads:
        result = asyncio.run(replay(wl, target, label=wl.name, **_replay_opts(args)))
        passes.append(report.Pass(args.url, wl.name, result.records, summarize(result.records, result.wall_s)))
    out = _out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    md = report.table(passes, args.url)
    print(md)
    (out / "summary.md").write_text(md)
    report.write_json(out / "results.json", {"argv": args.argv, "url": args.url}, passes)
    why_not = report.plot_ttft(out / "ttft.png", passes)
    print(f"results: {out}" + (f" ({why_not})" if why_not else ""))
    return 1 if any(p.summary.failed for p in passes) else 0


def _compare(args, workloads: list[Workload]) -> int:
    model = args.model or paired.default_model()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    contenders = [paired.kvfork_contender(m, model, args.threshold, args.server_arg) for m in modes]
    out = _out_dir(args)
    for name in (n.strip() for n in args.peers.split(",") if n.strip()):
        c = peers.contender(name, model, args.gguf, out)
        if c is not None:
            contenders.append(c)
    meta = {"argv": args.argv, "model": model, "modes": modes, "threshold": args.threshold,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    return paired.compare(contenders, workloads, out, meta, **_replay_opts(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["cluster"]:  # routing over replicas: a command of its own (tools/bench/cluster.py)
        from kvfork.tools.bench import cluster

        return cluster.main(argv[1:])
    if argv[:1] == ["spec"]:  # speculative decoding off and on: a command of its own (tools/bench/spec.py)
        from kvfork.tools.bench import spec

        return spec.main(argv[1:])
    args = _parser().parse_args(argv)
    args.argv = argv  # recorded with the results
    exit_on_sigterm()
    try:
        workloads = _workloads(args)
        if args.command == "run":
            return _run(args, workloads)
        return _compare(args, workloads)
    except (TraceError, ValueError) as e:
        print(f"kvfork bench: {e}", file=sys.stderr)
        return 2
