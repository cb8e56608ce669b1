"""torch's CPU tensors read by kv_reading.c (backends/kv_reading.py builds and loads it): a decode row's scores
and each block's weighted values from the stored integers, scales and biases, and a prefill chunk's rows decoded
to floats. torch's own products read a stored row only after casting its integers to float32 (kv_storage.py,
`Grouped`, which reads through them where the kernel cannot be built)."""

from __future__ import annotations

import functools

import torch

from kvfork.backends import kv_reading


class Kernel:
    """`scores`, `block_sums` and `decode` over CPU tensors whose last dim is contiguous (stored rows: uint8, a
    row's scales then its biases after its integers, as `Grouped` lays them out; queries, weights and decoded
    rows: float32)."""

    def __init__(self, library: kv_reading.Library):
        self.library = library

    def threads(self) -> int:
        return torch.get_num_threads() if self.library.threaded else 1

    def scores(self, q: torch.Tensor, stored: torch.Tensor, bits: int, group: int) -> torch.Tensor:
        """q [kv_heads, n, head_dim] (float32) against stored keys [kv_heads, t, width]: [kv_heads, n, t]."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        heads, n, dim = q.shape
        t = stored.shape[1]
        out = q.new_empty(heads, n, t)
        self.library.scores(q.data_ptr(), q.stride(0), q.stride(1), heads, n, dim, stored.data_ptr(),
                            stored.stride(0), stored.stride(1), t, bits, group, 1, dim // group, out.data_ptr(),
                            out.stride(0), out.stride(1), self.threads())
        return out

    def block_sums(self, w: torch.Tensor, stored: torch.Tensor, bits: int, group: int, dim: int, block: int,
                   weight_sums: torch.Tensor | None = None) -> torch.Tensor:
        """Weights w [kv_heads, n, t] (float32) of stored values [kv_heads, t, width], summed per `block` keys:
        [kv_heads, blocks, n, dim]; where `weight_sums` [kv_heads, blocks, n] (float32, contiguous) is given, each
        block's sum of weights is written there, added by halves (ordered_attention.halved's order)."""
        if weight_sums is not None and block > kv_reading.MOST_TREE:
            raise ValueError(f"the kernel adds the weights of blocks of at most {kv_reading.MOST_TREE} keys")
        w = w if w.stride(-1) == 1 else w.contiguous()
        heads, n, t = w.shape
        out = w.new_empty(heads, -(-t // block), n, dim)
        self.library.block_sums(w.data_ptr(), w.stride(0), w.stride(1), heads, n, dim, stored.data_ptr(),
                                stored.stride(0), stored.stride(1), t, bits, group, 1, dim // group, block,
                                out.data_ptr(), None if weight_sums is None else weight_sums.data_ptr(),
                                self.threads())
        return out

    def decode(self, stored: torch.Tensor, out: torch.Tensor, bits: int, group: int) -> None:
        """Stored rows [kv_heads, t, width] decoded into `out` [kv_heads, t, head_dim] (float32, its last dim
        contiguous)."""
        heads, t, dim = out.shape
        self.library.decode(stored.data_ptr(), stored.stride(0), stored.stride(1), heads, t, dim, bits, group, 1,
                            dim // group, out.data_ptr(), out.stride(0), out.stride(1), self.threads())


@functools.cache
def kernel() -> Kernel | None:
    """kv_reading.c for torch's tensors, or None where it cannot be built (kv_reading.library says why)."""
    library = kv_reading.library()
    return None if library is None else Kernel(library)
