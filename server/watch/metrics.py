"""Prometheus text exposition without a dependency: counters, gauges, histograms.

Only the control loop thread writes metrics (the runner reports through the event
queue), so nothing here locks.
"""

from __future__ import annotations

import bisect
from typing import Callable

Labels = tuple[tuple[str, str], ...]


def _fmt_value(v: float) -> str:
    """Exactly (Prometheus parses Go floats): `:g` would round a byte count of 3,014,656 to 3.01466e+06."""
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _fmt_labels(labels: Labels, extra: Labels = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in items) + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str):
        self.name, self.help = name, help

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str):
        super().__init__(name, help)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        rows = self.values or {(): 0.0}
        return self.header() + [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in sorted(rows.items())]


class Gauge(_Metric):
    """A value read when rendered, so it is never stale; `labels` are fixed (vLLM's model_name)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float], labels: Labels = ()):
        super().__init__(name, help)
        self.read, self.labels = read, labels

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_fmt_labels(self.labels)} {_fmt_value(self.read())}"]


class CounterView(Gauge):
    """A count kept elsewhere (it only grows), read when rendered."""

    kind = "counter"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self) -> list[str]:
        lines, running = self.header(), 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            lines.append(f'{self.name}_bucket{{le="{bound:g}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {_fmt_value(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


class Registry:
    def __init__(self, prefix: str = "kvfork_"):
        self.prefix = prefix
        self.metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> _Metric:
        metric.name = self.prefix + metric.name
        self.metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str) -> Counter:
        return self._add(Counter(name, help))  # type: ignore[return-value]

    def gauge(self, name: str, help: str, read: Callable[[], float], labels: Labels = ()) -> Gauge:
        return self._add(Gauge(name, help, read, labels))  # type: ignore[return-value]

    def counter_view(self, name: str, help: str, read: Callable[[], float], labels: Labels = ()) -> CounterView:
        return self._add(CounterView(name, help, read, labels))  # type: ignore[return-value]

    def histogram(self, name: str, help: str, buckets: tuple[float, ...]) -> Histogram:
        return self._add(Histogram(name, help, buckets))  # type: ignore[return-value]

    def render(self) -> str:
        return "\n".join(line for m in self.metrics.values() for line in m.render()) + "\n"
