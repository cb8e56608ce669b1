"""What a comparison leaves behind: the table, a JSON of every record, a TTFT plot."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvfork.tools.bench.client import Record
from kvfork.tools.bench.stats import Summary, output_differences, ratio


@dataclass
class Pass:
    """One workload replayed against one server (a kvfork mode or a peer)."""

    label: str
    preset: str
    records: list[Record]
    summary: Summary
    server_metrics: dict[str, float] = field(default_factory=dict)  # counter deltas over the pass
    kvfork: bool = True  # greedy outputs are compared only between kvfork passes


_COLUMNS = (  # (header, Summary field, format)
    ("TTFT p50 s", "ttft_p50", "{:.2f}"),
    ("TTFT p95 s", "ttft_p95", "{:.2f}"),
    ("TTFT p99 s", "ttft_p99", "{:.2f}"),
    ("recipient TTFT p50 s", "recipient_ttft_p50", "{:.2f}"),
    ("tail-only TTFT p50 s", "tail_ttft_p50", "{:.2f}"),
    ("recipient/tail-only", "recipient_over_tail", "{:.2f}×"),
    ("warm-prefix TTFT p50 s", "warm_ttft_p50", "{:.2f}"),
    ("recipient/warm-prefix", "recipient_over_warm", "{:.2f}×"),
    ("e2e p50 s", "e2e_p50", "{:.2f}"),
    ("prefill tokens", "prefill_tokens", "{:,}"),
    ("cached tokens", "cached_tokens", "{:,}"),
    ("from donors", "server_donor_tokens", "{:,}"),
    ("wall s", "wall_s", "{:.1f}"),
)


def _cell(value, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def table(passes: list[Pass], base: str) -> str:
    """One markdown table per preset, with `label/base` ratio rows after the figures."""
    out = []
    for preset in dict.fromkeys(p.preset for p in passes):
        rows = [p for p in passes if p.preset == preset]
        head = ["server", "requests", "failed"] + [c[0] for c in _COLUMNS]
        out += [f"**{preset}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for p in rows:
            s = p.summary
            cells = [p.label, str(s.requests), str(s.failed)]
            cells += [_cell(getattr(s, name), fmt) for _, name, fmt in _COLUMNS]
            out.append("| " + " | ".join(cells) + " |")
        ref = next((p for p in rows if p.label == base), None)
        for p in rows:
            if ref is None or p is ref:
                continue
            cells = [f"{p.label}/{base}", "", ""]
            for _, name, _ in _COLUMNS:
                r = ratio(getattr(p.summary, name), getattr(ref.summary, name))
                cells.append("–" if r is None else f"{r:.2f}×")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def checks(passes: list[Pass], base: str) -> tuple[list[str], int]:
    """Notes under the table, and how many greedy outputs differ between kvfork passes (should be 0)."""
    notes, differing = [], 0
    for p in passes:
        ref = next(q for q in passes if q.label == base and q.preset == p.preset)
        if p is ref:
            continue
        diff = output_differences(ref.records, p.records)
        kind = "greedy outputs" if p.kvfork else "outputs (a peer: different numerics, not checked)"
        shown = f" ({', '.join(diff[:5])}{', …' if len(diff) > 5 else ''})" if diff else ""
        notes.append(f"- {p.preset}, {p.label} vs {base}: {kind}: {len(diff)} of {sum(r.ok for r in p.records)} "
                     f"differ{shown}")
        differing += len(diff) if p.kvfork and ref.kvfork else 0
    for p in passes:
        s = p.summary
        if s.server_prefilled_tokens is not None and s.server_prefilled_tokens != s.prefill_tokens:
            notes.append(f"- {p.preset}, {p.label}: the server counted {s.server_prefilled_tokens:,} prefilled "
                         f"tokens, usage says {s.prefill_tokens:,}")
    return notes, differing


def write_json(path: Path, meta: dict, passes: list[Pass]) -> None:
    doc = {
        "meta": meta,
        "passes": [
            {
                "label": p.label,
                "preset": p.preset,
                "summary": p.summary.as_dict(),
                "server_metrics": p.server_metrics,
                "records": [asdict(r) for r in p.records],
            }
            for p in passes
        ],
    }
    path.write_text(json.dumps(doc, indent=1))


def plot_ttft(path: Path, passes: list[Pass]) -> str | None:
    """TTFT per request, one panel per preset, one line per server. Returns why not, if not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    presets = list(dict.fromkeys(p.preset for p in passes))
    fig, axes = plt.subplots(len(presets), 1, figsize=(9, 3.2 * len(presets)), squeeze=False)
    for ax, preset in zip(axes[:, 0], presets):
        for p in (p for p in passes if p.preset == preset):
            xs = [i for i, r in enumerate(p.records) if r.ok and r.ttft_s is not None]
            ax.plot(xs, [p.records[i].ttft_s for i in xs], marker="o", markersize=3, linewidth=1, label=p.label)
        ax.set_title(f"{preset}: time to first token per request")
        ax.set_xlabel("request (workload order)")
        ax.set_ylabel("TTFT (s)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
