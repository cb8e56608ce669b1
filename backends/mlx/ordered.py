"""--batch-invariant on MLX (the CPU): a position's keys and values, so its stored rows and the logits after them,
are bit for bit the same in every pass that computes it: alone, beside other rows of the decode batch, in other
prefill chunks, in a verify row, by decode. A quantized storage turns a last-bit difference into a step of its
grid, so this is what makes reuse on = off exact at int8 and int4 on a real model (docs/kv-budget.md).

- **Linear layers** (`OrderedLinear`, and a tied embedding's `as_linear`: `OrderedEmbedding`): MLX's float
  products go to the BLAS's `sgemm` (OpenBLAS on Linux), which sums an output in an order set by the token's
  place in the product: with the tokens as rows, by its place in 12-row tiles and their remainders; with the
  tokens as columns, by its place too from 8 columns at some shapes (64 or 128 outputs of 64 inputs; 256, 512 or
  1,024 of 576 on one thread, from 15 on two) and from 16 at the default model's (on one thread). A product with
  at most COLUMNS tokens as its columns summed each of them as a token alone, at every place, at every shape
  measured, on one thread and on two (AMD EPYC, OpenBLAS 0.3, 2026-12-07), so a layer multiplies its weights by
  the tokens COLUMNS at a time.
  Quantized weights (`nn.QuantizedLinear`, `nn.QuantizedEmbedding`) keep `mx.quantized_matmul`, which sums a
  row alike wherever it stands; `unordered_tokens` checks every kind at load.
- **Attention** reads the int8 or int4 rows in place in every pass (`kv_storage.QuantizedRows.ordered`,
  `cpu_attention.read_ordered`), in one order whatever the pass.
- **Norms, RoPE, the keys' rotation and the MLP's activation** work on each token's own elements.

What it refuses (`refusal`): a GPU (Metal's products were never measured here), a storage other than int8 or
int4 read by kv_reading.c, sliding-window and recurrent layers, mixtures of experts, a model that reads images,
a model split over ranks.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from kvfork.backends.base import KVStorageRefused, LayerAttention
from kvfork.backends.mlx import kv_storage

# The most tokens one product takes, as its columns
COLUMNS = 7
# Token counts `unordered_tokens` tries, the token alone and at the start, the middle and the end of the others
PROBED_TOKENS = (2, 5, COLUMNS, COLUMNS + 1, 2 * COLUMNS + 5, 64)


def products(weight: mx.array, x: mx.array) -> mx.array:
    """x @ weight.T, x [..., inputs]: the tokens COLUMNS at a time, as the columns of weight's product."""
    flat = x.reshape(-1, x.shape[-1])
    out = [(weight @ flat[i:i + COLUMNS].T).T for i in range(0, flat.shape[0], COLUMNS)]
    return mx.concatenate(out).reshape(*x.shape[:-1], weight.shape[0])


class OrderedLinear(nn.Linear):
    """nn.Linear, its tokens multiplied COLUMNS at a time (`products`)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = products(self["weight"], x)
        return y + self["bias"] if "bias" in self else y


class OrderedEmbedding(nn.Embedding):
    """nn.Embedding whose `as_linear` (a tied output layer) multiplies COLUMNS tokens at a time (`products`)."""

    def as_linear(self, x: mx.array) -> mx.array:
        return products(self.weight, x)


def refusal(layers: tuple[LayerAttention, ...], storage: kv_storage.Storage | None, model: nn.Module,
            reads_images: bool, ranks: int) -> str | None:
    """Why this model and storage cannot be computed batch-invariantly on MLX, or None."""
    if mx.default_device() == mx.gpu:
        return "on MLX, only on the CPU (its products on Metal were not measured); --backend torch on CUDA"
    if not isinstance(storage, kv_storage.QuantizedRows) or storage.kernel is None:
        return ("on MLX, attention reads int8 or int4 rows in place in its one order (kv_reading.c, which needs a C "
                "compiler): --kv-cache-dtype int8 or int4, or --backend torch for any storage")
    if any(layer.kind != "full" for layer in layers):
        return "on MLX, not for sliding-window or recurrent layers"
    if any(isinstance(m, (SwitchLinear, QuantizedSwitchLinear)) for _, m in model.named_modules()):
        return "on MLX, not for a mixture of experts"
    if reads_images:
        return "on MLX, not for a model that reads images"
    if ranks > 1:
        return "on MLX, not over several ranks"
    return None


def order(model: nn.Module, layers: tuple[LayerAttention, ...], storage: kv_storage.Storage | None,
          reads_images: bool, ranks: int) -> None:
    """Make the model's float linear layers, and an embedding that serves as the output layer, multiply their tokens
    COLUMNS at a time. KVStorageRefused where this model, its storage (attention ordered by it: `storage.ordered`)
    or this CPU's products cannot compute batch-invariantly (`refusal`, `unordered_tokens`)."""
    reason = refusal(layers, storage, model, reads_images, ranks)
    if reason is not None:
        raise KVStorageRefused(f"--batch-invariant: {reason}")
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = OrderedLinear
        elif type(module) is nn.Embedding:
            module.__class__ = OrderedEmbedding
    reason = unordered_tokens(model)
    if reason is not None:
        raise KVStorageRefused(f"--batch-invariant: {reason}")


def unordered_tokens(model: nn.Module) -> str | None:
    """Where one of the model's linear layers gives a token other bits beside other tokens than alone, or None. The
    order of a product's sums is a property of the CPU's BLAS and the shapes, not the values, so random tokens tell:
    at each of PROBED_TOKENS, the token at the start, the middle and the end."""
    rng = np.random.default_rng(0)
    layers: dict[tuple, tuple[str, int, mx.Dtype, Callable[[mx.array], mx.array]]] = {}
    for name, module in model.named_modules():
        run: Callable[[mx.array], mx.array]
        if isinstance(module, nn.QuantizedLinear):
            width, dtype, run = module["weight"].shape[1] * 32 // module.bits, module["scales"].dtype, module
        elif isinstance(module, nn.Linear):
            width, dtype, run = module["weight"].shape[1], module["weight"].dtype, module
        elif isinstance(module, nn.QuantizedEmbedding):
            width, dtype, run = module["weight"].shape[1] * 32 // module.bits, module["scales"].dtype, module.as_linear
        elif isinstance(module, OrderedEmbedding):
            width, dtype, run = module.weight.shape[1], module.weight.dtype, module.as_linear
        else:
            continue
        layers.setdefault((type(module), module["weight"].shape, dtype), (name, width, dtype, run))
    for name, width, dtype, run in layers.values():
        token = mx.array(rng.standard_normal((1, width), np.float32)).astype(dtype)
        alone = np.asarray(run(token)[0].astype(mx.float32))
        for count in PROBED_TOKENS:
            others = mx.array(rng.standard_normal((count, width), np.float32)).astype(dtype)
            for at in sorted({0, count // 2, count - 1}):
                beside = run(mx.concatenate([others[:at], token, others[at + 1:]]))
                if not np.array_equal(np.asarray(beside[at].astype(mx.float32)), alone):
                    return (f"this CPU's products give {name}'s token other bits at place {at} of {count} tokens "
                            "than alone")
    return None
