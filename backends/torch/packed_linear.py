"""Linear layers in oneDNN's blocked weight layout: float32 on the CPU.

Why: for the few rows of a decode step, torch's default CPU matmul (MKL's
sgemv for x @ w.T) reads weights at about 11 GB/s on the 2-core test machine,
a fifth of a plain read there, and it runs on one core whatever the thread
count. oneDNN's linear over a weight reordered once, at load, reads them at
21-30 GB/s: every weight of the default model in 18-23 ms for 1-8 rows against
45-71 ms, and 1.1-1.4x faster at 512-row prefill chunks (tools/linear_bench.py,
docs/benchmarks.md). Like MKL's, its sums are not invariant to the number of
rows; every path runs the same kernel, so reuse paths still match reuse off.

The reordered weight is opaque (a mkldnn tensor), so it is not a Parameter:
pack after the state dict is loaded, as the last step of installing a model.

oneDNN compiles one kernel per (weight shape, row count) and keeps it, about
0.4 MiB each, up to 1,024 of them: a varlen batch of every length from 1 to 600
held 480 MiB. So passes are padded to a few row counts (exact up to 16, the
decode batches; whole 16-row steps up to 64, where a pass is still read-bound
and a coarser step cost more than MKL's unpadded pass; whole 64-row steps up
to 2,048, the engine's default --max-batch-tokens; whole 512-row steps beyond),
and the kernels of those up to 2,048 are compiled at load, where their memory
is paid once, not mid-serving. oneDNN keeps them per process, keyed by shape and
row count (not by weight): a model loaded again, or another of the same shapes,
finds them compiled, so the warm-up passes (half a load's time on the default
model) run once per process, while the kernels fit oneDNN's cache.

The two oneDNN ops are torch's private ones (a leading underscore), checked for the torch versions
in TORCH_VERSIONS: tests/house/test_package.py pins that range to the installed torch and to
pyproject.toml's, so a torch upgrade fails a test instead of a load.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

TORCH_VERSIONS = ">=2.13,<2.14"  # checked; pyproject.toml pins the same range on Linux
EXACT_ROWS = 16
# (up to this many rows, padded to a multiple of this step)
STEPS = ((64, 16), (2048, 64), (None, 512))
WARM_ROWS = 2048
# oneDNN's primitive cache: the kernels it keeps per process, least recently used first out
KERNEL_CACHE = int(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024"))
_compiled: set[tuple[int, int, int]] = set()  # (out_features, in_features, rows) warmed in this process


def padded_rows(rows: int) -> int:
    """The row count a pass of `rows` runs at."""
    if rows <= EXACT_ROWS:
        return rows
    step = next(step for most, step in STEPS if most is None or rows <= most)
    return -(-rows // step) * step


def warm_rows() -> list[int]:
    return sorted({padded_rows(n) for n in range(1, WARM_ROWS + 1)})


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Measured for float32 on the CPU only; CUDA has its own kernels."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


# Row counts `unordered_rows` tries: each padded differently (`padded_rows`)
PROBED_ROWS = (2, 3, 16, 17, 80, 600)


class PackedLinear(nn.Module):
    """y = x @ w.T + b with w held in oneDNN's layout. `least_rows`: the fewest rows a pass runs at (2 where
    batch-invariant: a row's sums are then the same at every padded row count, measured on an Intel Xeon and an
    AMD EPYC, and checked at load by `unordered_rows`; at 1 row oneDNN sums the longer rows in another
    order)."""

    least_rows = 1

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach()

    @property
    def nbytes(self) -> int:
        """The weights' bytes (oneDNN's layout is opaque to `Tensor.nbytes`)."""
        bias = 0 if self.bias is None else self.bias.nbytes
        return self.out_features * self.in_features * self.packed.dtype.itemsize + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        padded = max(padded_rows(n), self.least_rows)
        if padded != n:
            rows = F.pad(rows, (0, 0, 0, padded - n))
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y[:n].view(*x.shape[:-1], self.out_features)


def unordered_rows(layers: list[PackedLinear]) -> str | None:
    """Why these layers cannot compute batch-invariantly, or None: each weight shape must give a row the same
    bits at every row count from two (PROBED_ROWS, on random values: the order is chosen by the shapes)."""
    generator = torch.Generator().manual_seed(0)
    tried = set()
    for layer in layers:
        if (layer.out_features, layer.in_features) in tried:
            continue
        tried.add((layer.out_features, layer.in_features))
        x = torch.randn(max(PROBED_ROWS), layer.in_features, generator=generator)
        first = torch.ops.mkldnn._linear_pointwise(x[:2], layer.packed, layer.bias, "none", [], "")[0]
        for rows in PROBED_ROWS[1:]:
            y = torch.ops.mkldnn._linear_pointwise(x[:padded_rows(rows)], layer.packed, layer.bias, "none", [], "")
            if not torch.equal(y[0], first):
                return (f"oneDNN sums a row of a {layer.in_features} -> {layer.out_features} layer in another order "
                        f"at {padded_rows(rows)} rows than at 2")
    return None


def pack(model: nn.Module, tied_head: torch.Tensor | None) -> None:
    """Swap every nn.Linear of `model` for a PackedLinear, in place. A model whose output projection
    is tied to its embedding gets a packed copy of the embedding as its `lm_head` (the lookups keep
    reading the table itself): on the default model, resident memory after load is 829 MiB against
    about 560 once plain weights have all been read."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
    if tied_head is not None:
        model.lm_head = PackedLinear(tied_head)
    # The rest (embeddings, norms) in memory of their own, so nothing keeps the weights file mapped:
    # its pages, all read once by the reorder, would otherwise stay resident beside the packed copies.
    for parameter in model.parameters():
        parameter.data = parameter.data.clone()
    warm(model)


@torch.inference_mode()
def warm(model: nn.Module) -> None:
    """Compile the kernel of every padded row count up to WARM_ROWS, once per weight shape (the
    output projection only up to EXACT_ROWS: it reads one row per session), skipping those this process
    compiled already. Past the kernel cache's size some may have been evicted: then all are warmed again."""
    seen = set()
    head = getattr(model, "lm_head", None)
    in_head = set(head.modules()) if head is not None else set()  # the head itself, or its rank's part
    for linear in model.modules():
        if not isinstance(linear, PackedLinear) or (linear.out_features, linear.in_features) in seen:
            continue
        seen.add((linear.out_features, linear.in_features))
        rows = range(1, EXACT_ROWS + 1) if linear in in_head else warm_rows()
        for n in rows:
            key = (linear.out_features, linear.in_features, n)
            if key in _compiled:
                continue
            if len(_compiled) >= KERNEL_CACHE:
                _compiled.clear()
            linear(torch.zeros(n, linear.in_features))
            _compiled.add(key)
