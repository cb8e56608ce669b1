"""Side by side: the same workloads against kvfork in several modes (and peers).

Servers run one after the other, never together, so they do not share the
CPU. Each server replays every workload; the presets use distinct prefixes, so
one preset never warms another's prefix cache.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvfork.server.generate.isolated import module_command
from kvfork.tools.bench import report
from kvfork.tools.bench.client import Target
from kvfork.tools.bench.runner import replay
from kvfork.tools.bench.serve import Metrics, ServerFailed, ServerProcess, metric_total, scrape_metrics
from kvfork.tools.bench.stats import summarize
from kvfork.tools.bench.workload import Workload

# How the daemon is started; tests point this at their OpenAI test double.
DAEMON = module_command("kvfork.server")

# kvfork's reuse modes: the flags that select them (a threshold of None: the daemon's default).
def _threshold(k: int | None) -> list[str]:
    return [] if k is None else ["--active-prefix-reuse-min-tokens", str(k)]


MODES = {
    "off": lambda k: ["--active-prefix-reuse-min-tokens", "0"],
    "on": lambda k: _threshold(k),
    "no-follow": lambda k: [*_threshold(k), "--no-follow"],
    "disk-off": lambda k: [*_threshold(k), "--prefix-cache-disk-bytes", "0"],  # "on" without the disk tier
}

# kvfork's counters (server/engine/loop/telemetry.py): cross-checks of the usage figures.
PREFILLED, REUSED = "kvfork_prefilled_tokens_total", "kvfork_reused_tokens_total"


@dataclass
class Contender:
    """A server to measure: how to start it, and whether it is kvfork."""

    label: str
    make: Callable[[Path], ServerProcess]  # log path -> a server not yet started
    model_name: str | None = None  # the request's model field, for servers that want one
    kvfork: bool = True


def default_model() -> str:
    """The default model's folder, fetched and converted on first use."""
    from kvfork.backends.default_model import ensure_default_model

    return str(ensure_default_model())


def kvfork_contender(mode: str, model: str, threshold: int | None, extra: list[str]) -> Contender:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    argv = [*DAEMON, "--model", model, "--port", "{port}", *MODES[mode](threshold), *extra]

    def make(log: Path) -> ServerProcess:
        # A KVFORK_HOME of its own: the disk tier would carry the prefixes an earlier server spilled
        # at its shutdown (an earlier mode, or an earlier run) into this one's passes.
        home = Path(tempfile.mkdtemp(prefix=f"kvfork-bench-{mode}-"))
        return ServerProcess(f"kvfork ({mode})", argv, log, env={"KVFORK_HOME": str(home)}, scratch=home)

    return Contender(mode, make)


def counter_delta(before: Metrics, after: Metrics) -> Metrics:
    """What changed over a pass (meaningful for counters; gauges are kept as their change too)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


async def _run_all(srv: ServerProcess, c: Contender, workloads: list[Workload], **replay_opts) -> list[report.Pass]:
    target = Target(srv.base_url, c.model_name)
    passes = []
    for wl in workloads:
        before = scrape_metrics(srv.base_url)
        result = await replay(wl, target, label=f"{c.label} {wl.name}", **replay_opts)
        after = scrape_metrics(srv.base_url)
        summary = summarize(result.records, result.wall_s)
        delta = counter_delta(before, after)
        if (prefilled := metric_total(delta, PREFILLED)) is not None:
            summary.server_prefilled_tokens = int(prefilled)
            summary.server_donor_tokens = int(metric_total(delta, REUSED, source="donor") or 0)
        passes.append(report.Pass(c.label, wl.name, result.records, summary, delta, c.kvfork))
    return passes


def compare(contenders: list[Contender], workloads: list[Workload], out_dir: Path, meta: dict, **replay_opts) -> int:
    """Run every workload on every contender, then print and write the report. Returns an exit code."""
    out_dir.mkdir(parents=True, exist_ok=True)
    passes: list[report.Pass] = []
    skipped = []
    for c in contenders:
        print(f"== {c.label}: starting", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            with c.make(out_dir / f"{c.label}.log") as srv:
                print(f"== {c.label}: ready in {time.monotonic() - t0:.1f}s at {srv.base_url}", file=sys.stderr)
                passes += asyncio.run(_run_all(srv, c, workloads, **replay_opts))
        except ServerFailed as e:
            print(f"== {c.label}: skipped: {e}", file=sys.stderr)
            skipped.append(c)
    if not passes:
        print("no server could be measured", file=sys.stderr)
        return 1
    base = passes[0].label
    notes, differing = report.checks(passes, base)
    lines = [report.table(passes, base), *notes]
    failed = sum(p.summary.failed for p in passes)
    if skipped:
        lines.append(f"- skipped (could not start): {', '.join(c.label for c in skipped)}")
    summary_md = "\n".join(lines) + "\n"
    print(summary_md)
    (out_dir / "summary.md").write_text(summary_md)
    report.write_json(out_dir / "results.json", {**meta, "skipped": [c.label for c in skipped]}, passes)
    why_not = report.plot_ttft(out_dir / "ttft.png", passes)
    print(f"results: {out_dir}/results.json, summary.md" + (f"; {why_not}" if why_not else ", ttft.png"))
    if failed:
        print(f"FAILED: {failed} request(s) failed", file=sys.stderr)
    if differing:
        print(f"FAILED: {differing} greedy output(s) differ between kvfork modes", file=sys.stderr)
    if any(c.kvfork for c in skipped):
        print("FAILED: a kvfork server did not start", file=sys.stderr)
    return 1 if failed or differing or any(c.kvfork for c in skipped) else 0
