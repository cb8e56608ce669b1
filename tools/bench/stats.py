"""Percentiles and the per-pass summary the tables are made of."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from kvfork.tools.bench.client import Record


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Summary:
    requests: int
    failed: int
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_p99: float | None
    recipient_ttft_p50: float | None  # over RECIPIENT_TAGS
    tail_ttft_p50: float | None  # recipients' tails alone on the idle server (staggered)
    recipient_over_tail: float | None  # recipient TTFT / its tail's TTFT alone, p50 over recipients
    warm_ttft_p50: float | None  # a fresh tail over the cached prefix on the idle server (staggered)
    recipient_over_warm: float | None  # recipient TTFT / its warm reference's, p50 over recipients
    e2e_p50: float | None
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int  # computed: prompt - cached, summed over requests
    output_tokens: int
    wall_s: float
    # From the server's /metrics over the pass, where it has them (kvfork).
    server_prefilled_tokens: int | None = None
    server_donor_tokens: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# Requests sent while another with the same prefix runs: where active reuse can act.
RECIPIENT_TAGS = ("recipient", "fork")
# Reference calls on the idle server (a recipient's tail alone; a fresh tail over the cached prefix),
# left out of the workload's own latencies.
TAIL_TAG, WARM_TAG = "tail", "warm"
REFERENCE_TAGS = (TAIL_TAG, WARM_TAG)


def _reference_ratios(ok: list[Record], tag: str) -> list[float]:
    """Each recipient's TTFT over its reference's (calls `<name>-<i>` and `<name>-<tag>-<i>`)."""
    by_id = {r.call_id: r for r in ok if r.ttft_s}
    out = []
    for r in ok:
        if r.tag == tag and r.ttft_s:
            name, _, i = r.call_id.rpartition(f"-{tag}-")
            recipient = by_id.get(f"{name}-{i}")
            if recipient is not None:
                out.append(recipient.ttft_s / r.ttft_s)
    return out


def summarize(records: list[Record], wall_s: float) -> Summary:
    ok = [r for r in records if r.ok]
    tails = [r.ttft_s for r in ok if r.tag == TAIL_TAG and r.ttft_s is not None]
    warms = [r.ttft_s for r in ok if r.tag == WARM_TAG and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None and r.tag not in REFERENCE_TAGS]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    return Summary(
        requests=len(records),
        failed=len(records) - len(ok),
        ttft_p50=percentile(ttfts, 50),
        ttft_p95=percentile(ttfts, 95),
        ttft_p99=percentile(ttfts, 99),
        recipient_ttft_p50=percentile((r.ttft_s for r in ok if r.tag in RECIPIENT_TAGS and r.ttft_s is not None), 50),
        tail_ttft_p50=percentile(tails, 50),
        recipient_over_tail=percentile(_reference_ratios(ok, TAIL_TAG), 50),
        warm_ttft_p50=percentile(warms, 50),
        recipient_over_warm=percentile(_reference_ratios(ok, WARM_TAG), 50),
        e2e_p50=percentile((r.e2e_s for r in ok if r.e2e_s is not None and r.tag not in REFERENCE_TAGS), 50),
        prompt_tokens=prompt,
        cached_tokens=cached,
        prefill_tokens=prompt - cached,
        output_tokens=sum(r.output_tokens or 0 for r in ok),
        wall_s=wall_s,
    )


def output_differences(base: list[Record], other: list[Record]) -> list[str]:
    """Ids of calls that both passes answered but with different text (greedy: should be none)."""
    theirs = {r.call_id: r for r in other}
    return [
        r.call_id
        for r in base
        if r.ok and r.call_id in theirs and theirs[r.call_id].ok and theirs[r.call_id].text != r.text
    ]


def ratio(on: float | None, off: float | None) -> float | None:
    if on is None or off is None or off == 0:
        return None
    return on / off
