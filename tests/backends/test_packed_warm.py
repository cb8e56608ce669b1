"""oneDNN's kernels are compiled once per process: a second model of the same shapes (or the same model
loaded again) runs no warm-up pass, and its answers are the same as the first's."""

import pytest
import torch
from torch import nn

from kvfork.backends.torch import packed_linear

pytestmark = pytest.mark.skipif(not packed_linear.available(torch.device("cpu"), torch.float32),
                                reason="oneDNN is not available")


def make(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24))


def counted(monkeypatch) -> list[int]:
    """The rows of every pass a PackedLinear runs."""
    rows, forward = [], packed_linear.PackedLinear.forward

    def spy(self, x):
        rows.append(x.shape[0])
        return forward(self, x)

    monkeypatch.setattr(packed_linear.PackedLinear, "forward", spy)
    return rows


def test_second_pack_skips_the_warm_up(monkeypatch):
    monkeypatch.setattr(packed_linear, "_compiled", set())
    rows = counted(monkeypatch)
    first, x = make(0), torch.randn(5, 24)
    packed_linear.pack(first, None)
    assert len(rows) == 2 * len(packed_linear.warm_rows())  # two shapes, every padded row count
    rows.clear()
    again = make(0)
    packed_linear.pack(again, None)
    assert rows == []
    with torch.inference_mode():
        assert torch.equal(again(x), first(x))  # the same weights through the same kernel


def test_a_full_kernel_cache_warms_again(monkeypatch):
    monkeypatch.setattr(packed_linear, "_compiled", set())
    monkeypatch.setattr(packed_linear, "KERNEL_CACHE", 3)
    rows = counted(monkeypatch)
    packed_linear.pack(make(0), None)
    rows.clear()
    packed_linear.pack(make(1), None)
    assert len(rows) > 0  # what was compiled may have left oneDNN's cache: warmed again
