"""`kvfork bench spec`: speculative decoding off and on, in one run, on the same prompts.

    kvfork bench spec [--model FOLDER] [--speculative prompt,suffix] [--runs 5] [--concurrency 1,4]

One daemon per mode starts (`--speculative off` and each mode asked), all resident, and they take
traffic one at a time, never together: each run sends every workload (tools/bench/spec_workloads.py)
at each concurrency to each daemon, the order reversed from run to run. Per workload and concurrency the
report gives decode tokens/s (output tokens after the first over the time from the first token to
the last reply's end), the median of the runs and their spread (min-max), and the speedup of the
medians.

Acceptance, two ways:
- served: the daemon's drafted and accepted counters per source, where /metrics has them;
- offline: the drafters (server/engine/worker/drafts.py) replayed over the off daemon's greedy replies,
  token by token as verification would take them (a draft's accepted run is its common prefix
  with the reply; the step then commits one more token). Tokens per step is the reply's length
  over the steps it then takes: the most a speedup can be when a verify step costs one decode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kvfork.tools.bench import paired
from kvfork.tools.bench.client import Record, Target, request_body, stream_chat
from kvfork.tools.bench.serve import ServerProcess, exit_on_sigterm, scrape_metrics
from kvfork.tools.bench.spec_replay import Replay
from kvfork.tools.bench.spec_workloads import WORKLOADS, SpecJob, jobs

# The daemon's speculation counters (labelled by source), read where it has them.
DRAFTED, ACCEPTED = "kvfork_spec_drafted_tokens_total", "kvfork_spec_accepted_tokens_total"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvfork bench spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the default model, fetched if needed)")
    ap.add_argument("--speculative", default="suffix", type=_modes,
                    help="the modes measured against off, comma-separated: prompt, suffix (default: %(default)s)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--concurrency", default="1,4", help="requests sent together (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="alternating runs, median taken (default: %(default)s)")
    ap.add_argument("--code-lines", type=int, default=150, help="code-edit: lines of the file")
    ap.add_argument("--code-tokens", type=int, default=2400, help="code-edit: reply limit")
    ap.add_argument("--agent-tokens", type=int, default=64, help="agent: reply limit")
    ap.add_argument("--prose-tokens", type=int, default=256, help="prose: reply limit")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="extra daemon flag")
    ap.add_argument("--offline-only", action="store_true",
                    help="start one daemon (speculation off) and report the offline acceptance alone")
    ap.add_argument("--reference", action="store_true",
                    help="no daemon: the offline acceptance over the reference replies (code-edit: the file with the "
                         "edit applied; agent: the script's next assistant turn)")
    ap.add_argument("--out", help="results folder (default: out/bench/<time>-spec)")
    return ap


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("prompt", "suffix") for m in modes):
        raise argparse.ArgumentTypeError(f"modes are prompt and suffix, comma-separated, not {text!r}")
    return modes


def _sizes(args) -> dict:
    return dict(code_lines=args.code_lines, code_tokens=args.code_tokens, agent_tokens=args.agent_tokens,
                prose_tokens=args.prose_tokens)


def _daemon(mode: str, model: str, extra: list[str], out: Path) -> ServerProcess:
    home = Path(tempfile.mkdtemp(prefix=f"kvfork-bench-spec-{mode}-"))
    argv = [*paired.DAEMON, "--model", model, "--port", "{port}", "--speculative", mode, *extra]
    return ServerProcess(f"kvfork (speculative {mode})", argv, out / f"{mode}.log",
                         env={"KVFORK_HOME": str(home)}, scratch=home)


async def _wave(url: str, wave: list[SpecJob]) -> tuple[list[Record], float]:
    """Send the jobs together; their records and decode tokens/s."""
    target, t0 = Target(url), time.monotonic()
    async with aiohttp.ClientSession() as http:
        recs = await asyncio.gather(*(
            stream_chat(http, target, Record(f"j{i}", f"j{i}", "spec"),
                        request_body(j.messages, j.max_tokens, None, ignore_eos=False), t0)
            for i, j in enumerate(wave)))
    failed = [r.error for r in recs if not r.ok]
    if failed:
        raise RuntimeError(f"a request failed: {failed[0]}")
    first = min(r.send_s + r.ttft_s for r in recs)
    end = max(r.send_s + r.e2e_s for r in recs)
    decoded = sum(max(0, (r.output_tokens or 0) - 1) for r in recs)
    return recs, decoded / max(end - first, 1e-9)


def _counters(url: str) -> dict[str, float]:
    """Drafted and accepted tokens per source, from the daemon's /metrics (empty where it has none)."""
    out: dict[str, float] = {}
    for key, value in scrape_metrics(url).items():
        name = key.split("{")[0]
        if name in (DRAFTED, ACCEPTED):
            source = key.split('source="')[1].split('"')[0] if 'source="' in key else "all"
            label = f"{'drafted' if name == DRAFTED else 'accepted'}:{source}"
            out[label] = out.get(label, 0.0) + value
    return out


def _run(args, model: str, out: Path) -> dict:
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    modes = ["off"] if args.offline_only else ["off", *args.speculative]
    sizes = _sizes(args)
    speed: dict[str, list[float]] = {}
    served: dict[str, dict[str, float]] = {}
    replay = Replay(model, args.speculative[-1])
    with contextlib.ExitStack() as stack:
        urls = {m: stack.enter_context(_daemon(m, model, args.server_arg, out)).base_url for m in modes}
        for run in range(args.runs):
            order = modes if run % 2 == 0 else modes[::-1]
            for name in names:
                for c in levels:
                    wave = jobs(name, run * 100 + c, c, **sizes)
                    for mode in order:
                        before = _counters(urls[mode])
                        recs, tps = asyncio.run(_wave(urls[mode], wave))
                        after = _counters(urls[mode])
                        speed.setdefault(f"{name}|{c}|{mode}", []).append(tps)
                        bucket = served.setdefault(f"{name}|{mode}", {})
                        for k, v in after.items():
                            bucket[k] = bucket.get(k, 0.0) + v - before.get(k, 0.0)
                        if mode == "off":
                            done = sorted(zip(wave, recs), key=lambda jr: jr[1].send_s + (jr[1].e2e_s or 0))
                            replay.add(name, [(job, rec.text) for job, rec in done])
                        print(f"run {run + 1} {name} c={c} {mode}: {tps:.1f} tok/s", file=sys.stderr, flush=True)
    return {"speed": speed, "served": served, "offline": replay.summary(), "levels": levels, "names": names}


def _reference(args, model: str) -> dict:
    """Offline acceptance over the workloads' reference replies, as many runs as asked."""
    names = [w.strip() for w in args.workloads.split(",") if w.strip() != "prose"]
    sizes = _sizes(args)
    replay = Replay(model, args.speculative[-1])
    for run in range(args.runs):
        for name in names:
            for c in (int(c) for c in args.concurrency.split(",") if c.strip()):
                replay.add(name, [(job, job.reference) for job in jobs(name, run * 100 + c, c, **sizes)])
    return {"speed": {}, "served": {}, "offline": replay.summary(), "levels": [], "names": names}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def table(result: dict, modes: list[str]) -> str:
    head = "".join(f" {m} tok/s | {m} speedup |" for m in modes)
    lines = [f"| workload | concurrent | off tok/s, median (min-max) |{head}", "|---|---|---|" + "---|---|" * len(modes)]
    lines = lines if result["levels"] else []
    for name in result["names"]:
        for c in result["levels"]:
            off = result["speed"][f"{name}|{c}|off"]
            cells = ""
            for mode in modes:
                on = result["speed"].get(f"{name}|{c}|{mode}")
                ratio = f"{statistics.median(on) / statistics.median(off):.2f}x" if on else "-"
                cells += f" {_spread(on) if on else '-'} | {ratio} |"
            lines.append(f"| {name} | {c} | {_spread(off)} |{cells}")
    lines += [""] * bool(lines) + ["| workload | source | drafted | accepted | acceptance | tokens per step |", "|---|---|---|---|---|---|"]
    for name in result["names"]:
        for source, row in sorted(result["offline"].get(name, {}).items()):
            lines.append(f"| {name} (offline) | {source} | {row['drafted']} | {row['accepted']} | "
                         f"{row['acceptance']:.0%} | {row['tokens_per_step']:.2f} |")
        for mode in modes:
            counters = result["served"].get(f"{name}|{mode}", {})
            for key in sorted(k for k in counters if k.startswith("drafted:")):
                source = key.split(":", 1)[1]
                drafted, accepted = counters[key], counters.get(f"accepted:{source}", 0.0)
                share = f"{accepted / drafted:.0%}" if drafted else "-"
                lines.append(f"| {name} (served, {mode}) | {source} | {drafted:.0f} | {accepted:.0f} | {share} | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    exit_on_sigterm()
    model = args.model or paired.default_model()
    out = Path(args.out or f"out/bench/{time.strftime('%Y%m%d-%H%M%S')}-spec")
    out.mkdir(parents=True, exist_ok=True)
    result = _reference(args, model) if args.reference else _run(args, model, out)
    md = table(result, args.speculative)
    print(md)
    (out / "summary.md").write_text(md)
    meta = {"argv": argv if argv is not None else sys.argv[1:], "model": model,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    (out / "results.json").write_text(json.dumps({**meta, **result}, indent=1))
    print(f"results: {out}", file=sys.stderr)
    return 0
