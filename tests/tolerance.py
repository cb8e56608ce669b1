"""One error model for every comparison between two computation paths of one model.

kvfork computes the same answer along different paths: a session decoded in a batch or alone,
on MLX or on torch, over shared blocks or its own contiguous KV, cloned or prefilled fresh,
restored from disk or recomputed, resumed from a recurrent checkpoint or run from the start,
prefilled in chunks or at once. In exact arithmetic the paths agree. In floating point each
path rounds in its own order (a BLAS picks other kernels for 4 rows than for 1, OpenBLAS and
MKL block their sums differently, MLX and torch order a layer's operations differently), so
the results differ in their last bits. This module bounds how far, from the arithmetic alone,
and every comparison in tests/ goes through it.

The model
---------
- A rounding in a format is off by at most its unit roundoff u of the value rounded: float32
  2^-24 = 6.0e-8; TF32 (tensor cores' float32) and float16 2^-11; bfloat16 2^-8.
- A sum of n products, accumulated in float32, is off by about u * sqrt(n) of its magnitude: the
  roundings of its partial sums are independent and of either sign (the probabilistic model of
  Higham and Mary, SIAM J. Sci. Comput. 2019; the worst case, n * u, needs every rounding to go
  the same way, which blocked BLAS kernels make all the less likely). Operands held in a
  narrower format add their own rounding, twice per product: sqrt(n u32^2 + 2 u^2) in all.
- A forward pass chains its sums: per layer the norm and the projections (over the hidden
  size), the attention's softmax normaliser and weighted values (over the context: a recurrent
  layer's state sums over the same tokens), the MLP's down projection (over its width), then
  the final norm and the head (`Model.reductions`). RMSNorm keeps an error relative to the
  scale of what it normalises, and the residual stream carries it forward with a gain near 1,
  so the sums' independent errors add in quadrature: one path's logits are off by about
  u * sqrt(N) of their scale, N the sum of all those lengths. The scale is max |logit|: a logit
  near zero carries the error of the whole vector, not one of its own magnitude (a relative
  tolerance per element, rtol, failed on a logit of 0.006 beside logits of 30). Values computed
  apart, with no sum between them (`each`), are scaled by their own magnitudes instead.
- Two paths each that far from the exact result differ by at most twice that. The bound allows
  `CONFIDENCE` = 8 times it: with independent roundings a sum strays past lambda * sqrt(n) * u
  with probability at most 2 exp(-lambda^2 / 2), 2.5e-14 at lambda = 8, so the tens of thousands
  of values a run compares never fail by chance.

    bound = 2 * CONFIDENCE * sqrt(sum over the sums of (n u32^2 + 2 u^2)) * max |reference|
          ~ 16 * u * sqrt(N) * max |logit|  in float32: 3.3e-5 of it for the llama test model
            (hidden 64, MLP 128, 2 layers) at 40 tokens, 6.8e-5 at 1,000

The gain near 1 is the one assumption about the model: the tiny random test models are drawn so
that it holds (tests/tiny_models.py, tests/tiny_hybrid_models.py: peaked logits, slow recurrent
decays). A model that amplifies float32 noise (fast decays read through a gated norm) breaks
it, and should be fixed in its weights, not absorbed here. A formula known to amplify (exp at
a large argument) states its `condition`.

A bound that cannot fail is no bound: house/test_tolerance.py shows every comparison kind catching a
deliberately wrong path (RoPE one position off, one KV row dropped, a recurrent state one step
stale) by at least ten bounds. docs/benchmarks.md ("Test tolerances") has the largest difference
each kind showed against its bound under several BLAS builds, with and without the OpenBLAS
preload; every run prints the same (conftest.py). Where both paths run the same kernels on the
same shapes, the tests stay bit-exact (np.testing.assert_array_equal) instead.

Two comparisons follow from the same roundings by their own formulas. A log-softmax over V logits
(logprobs) subtracts the maximum and the log of a normaliser, a sum of V terms of at most 1 and at
least one equal to 1: its relative error u * sqrt(V) becomes an absolute one through the log, so each
logprob is off by u * sqrt(V) of 1 plus its own magnitude (`assert_logprobs_close`). A weight stored in
a block quantization (GGUF's Q8_0, Q4_0, ...) is rounded to a grid of steps of its block's largest
magnitude (or range) over the format's levels: off by half a step, a whole one where the top level
clips, plus the scale's rounding to float16 (`assert_dequantized_close`, a bound that holds always); KV state
stored in int8 / int4 groups is the same grid per token (`assert_grouped_close`).

"The same greedy tokens" (the user's contract, GUIDE.md) is asserted as tokens plus logits:
the logits each token was picked from within the bound, and the tokens equal wherever the
reference's top-two margin exceeds twice the bound (past a near tie either token is a right
answer, and the two sequences part there).
"""

from __future__ import annotations

import enum
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

# The unit roundoff u = 2^-p of each format with p bits of significand (implicit bit included).
UNIT_ROUNDOFF = {"float32": 2.0**-24, "tfloat32": 2.0**-11, "float16": 2.0**-11, "bfloat16": 2.0**-8}
CONFIDENCE = 8.0


class Kind(enum.Enum):
    """The two paths a comparison puts side by side (the report counts each apart)."""

    BATCHED = "batched vs alone"
    BACKENDS = "MLX vs torch"
    BLOCKS = "blocked/shared KV vs contiguous"
    CLONE = "clone vs fresh prefill"
    DISK = "disk restore vs recompute"
    CHECKPOINT = "checkpoint vs full recompute"
    CHUNKED = "chunked vs whole prefill"
    RANKS = "tensor parallel ranks vs one process"
    FORMS = "two forms of one computation"  # a layer's formulas, a checkpoint layout, a kernel


@dataclass(frozen=True)
class Model:
    """The sizes a forward pass sums over, from the model's config.json."""

    hidden: int
    ffn: int  # the widest MLP (a MoE's largest expert or shared expert)
    layers: int

    @classmethod
    def of(cls, folder: str | Path) -> Model:
        config = json.loads((Path(folder) / "config.json").read_text())
        text = config.get("text_config", config)
        widths = ("intermediate_size", "block_ff_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "shared_intermediate_size")
        layers = text.get("num_hidden_layers") or len(text["hybrid_override_pattern"])
        return cls(text["hidden_size"], max(text.get(w) or 0 for w in widths), layers)

    def reductions(self, context: int) -> tuple[int, ...]:
        """The lengths of the sums one logit goes through, for a last token that sees `context` tokens."""
        h = self.hidden
        layer = (h, h, context, context, h, h, h, self.ffn)  # norm, q/k/v, softmax, values, out; norm, up, down
        return layer * self.layers + (h, h)  # final norm, head


def bound(scale, reductions: Sequence[int], dtype: str = "float32", condition: float = 1.0):
    """The largest difference allowed between two paths' results of magnitude `scale`: sums of the
    lengths `reductions` in series, over operands in `dtype` (each rounded once per product),
    accumulated in float32; `condition`: how much the computation amplifies a relative error of its
    inputs, where that is known to exceed the model's 1 (a formula, not a model)."""
    u, u_sum = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF["float32"]
    return 2 * CONFIDENCE * condition * math.sqrt(sum(n * u_sum**2 + 2 * u**2 for n in reductions)) * scale


# The largest difference each kind showed within its bound in this run, and the nearest tie a greedy
# step met (its top-two margin over twice the bound: below 1 either token is right): conftest prints them.
worst: dict[Kind, tuple[float, float, float, str]] = {}  # kind -> (difference / bound, difference, bound, where)
closest_tie: list = [math.inf, ""]  # [margin / (2 * bound), where]


def assert_arrays_close(got, want, *, kind: Kind, reductions: Sequence[int], dtype: str = "float32",
                        condition: float = 1.0, each: bool = False) -> float:
    """got within the bound of want (arrays of one shape), scaled by max |want|, or with `each` (values
    computed apart, by formulas without sums between them) by each value's own magnitude. Returns the
    largest difference against its bound (1 = at the bound)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape and want.size, f"{kind.value}: shapes {got.shape} and {want.shape}"
    assert np.isfinite(want).all() and np.isfinite(got).all(), f"{kind.value}: values that are not finite"
    scale = np.abs(want) if each else np.full(want.shape, np.abs(want).max())
    allowed = bound(scale, reductions, dtype, condition)
    diff = np.abs(got - want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(diff == 0, 0.0, diff / allowed)
    at = np.unravel_index(int(ratios.argmax()), want.shape)
    ratio = float(ratios[at])
    if ratio <= 1 and (kind not in worst or ratio > worst[kind][0]):
        worst[kind] = (ratio, float(diff[at]), float(allowed[at]),
                       os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0])
    if ratio > 1:
        raise AssertionError(
            f"{kind.value}: differ by {diff[at]:.3g} at {tuple(int(i) for i in at)} ({got[at]:.7g} against "
            f"{want[at]:.7g}), {ratio:.1f}x the bound {allowed[at]:.3g} (tolerance.py: {dtype} operands, sums of "
            f"{sum(reductions)} terms in all, scale {scale[at]:.4g})")
    return ratio


def assert_logprobs_close(got, want, *, vocab: int, dtype: str = "float32") -> float:
    """Logprobs of a log-softmax over `vocab` logits computed along two paths (a backend's sampler and a
    float64 reference): each within the bound of a sum of `vocab` terms, scaled by 1 plus its own magnitude.
    Returns the largest difference against its bound."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape and want.size, f"logprobs: shapes {got.shape} and {want.shape}"
    allowed = bound(1 + np.abs(want), (vocab,), dtype)
    ratio = float((np.abs(got - want) / allowed).max())
    assert ratio <= 1, f"logprobs: {got.tolist()} against {want.tolist()}, {ratio:.1f}x the bound (tolerance.py)"
    return ratio


# A block quantization's step as a share of its block's largest magnitude (Q4_1: of its range), and the
# values per block: llama.cpp's Q8_0 rounds to 127 levels each side, Q4_0 and Q5_0 to 8 and 16 (the top one
# clipped to 7 and 15), Q4_1 to 15 steps from the block's minimum.
QUANT_STEP = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q5_0": 1 / 16, "Q4_1": 1 / 15}
QUANT_BLOCK = 32


def assert_dequantized_close(got, want, fmt: str) -> float:
    """Weights stored in GGUF format `fmt` and read back (`got`) within one step of the originals, per block
    of QUANT_BLOCK values along the last axis, the float16 scale's rounding included; a float format
    (F32, F16, BF16) within its unit roundoff of each value. Returns the largest difference against it."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape and want.size, f"{fmt}: shapes {got.shape} and {want.shape}"
    if fmt in QUANT_STEP:
        blocks = want.reshape(*want.shape[:-1], -1, QUANT_BLOCK)
        spread = np.ptp(blocks, axis=-1) if fmt == "Q4_1" else np.abs(blocks).max(axis=-1)
        step = QUANT_STEP[fmt] * spread * (1 + 2 * UNIT_ROUNDOFF["float16"])
        offset = UNIT_ROUNDOFF["float16"] * np.abs(want).max()  # Q4_1's minimum, rounded to float16
        allowed = np.repeat(step, QUANT_BLOCK, axis=-1).reshape(want.shape) + offset
    else:
        allowed = {"F32": 0.0, "F16": UNIT_ROUNDOFF["float16"], "BF16": UNIT_ROUNDOFF["bfloat16"]}[fmt] * np.abs(want)
    diff = np.abs(got - want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = float(np.where(diff == 0, 0.0, diff / allowed).max())
    assert ratio <= 1, f"{fmt}: differs by {diff.max():.3g}, {ratio:.1f}x its quantization step (tolerance.py)"
    return ratio


def assert_logits_close(got, want, *, kind: Kind, model: Model, context: int, dtype: str = "float32") -> float:
    """Logits of one model computed along two paths, for last tokens that see at most `context` tokens;
    returns the largest difference against its bound."""
    return assert_arrays_close(got, want, kind=kind, reductions=model.reductions(context), dtype=dtype)


def top_two_margin(row) -> float:
    row = np.asarray(row, dtype=np.float64).reshape(-1)
    top = np.partition(row, -2)[-2:]
    return float(top[1] - top[0])


def assert_same_greedy(got: tuple[Sequence[int], Sequence], want: tuple[Sequence[int], Sequence], *, kind: Kind,
                       model: Model, context: int, dtype: str = "float32") -> int:
    """Greedy continuations along two paths: (tokens, the logits each token was picked from) each.
    The logits within the bound; the tokens equal wherever the reference's top-two margin exceeds
    twice the bound. Returns how many steps agree (all of them, unless a near tie parted them)."""
    (got_tokens, got_logits), (want_tokens, want_logits) = got, want
    assert len(got_tokens) == len(want_tokens) == len(got_logits) == len(want_logits)
    for step, (g, w) in enumerate(zip(got_logits, want_logits)):
        assert_logits_close(g, w, kind=kind, model=model, context=context, dtype=dtype)
        w = np.asarray(w, dtype=np.float64).reshape(-1)
        allowed = bound(float(np.abs(w).max()), model.reductions(context), dtype)
        margin = top_two_margin(w)
        if margin / (2 * allowed) < closest_tie[0]:
            closest_tie[:] = [margin / (2 * allowed), os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]]
        if got_tokens[step] != want_tokens[step]:
            assert margin <= 2 * allowed, (
                f"{kind.value}: step {step} picked {got_tokens[step]} against {want_tokens[step]}, with a top-two "
                f"margin of {margin:.3g}: more than twice the bound {allowed:.3g}")
            return step  # a near tie: both are right, and the continuations part here
    return len(want_tokens)


def assert_grouped_close(got, want, *, bits: int, group: int, to_grid: bool = False) -> float:
    """KV state stored as `bits`-bit integers in groups of `group` values along the last axis, each group with a
    scale and bias of float16 or wider (--kv-cache-dtype int8 / int4), read back (`got`) against what was written:
    within half a step of the group (its range over 2^bits - 1 levels) where each value takes the nearest level,
    plus the scale's and bias's roundings, 2^-10 of the group's largest magnitude. With `to_grid` (mx.quantize) the
    group's edge of larger magnitude is a whole number of steps (the bias), which widens the step by up to
    2^(1 - bits) and may clamp the other edge by a step: within a whole step, plus the values' own float16
    rounding besides, 2^-9. Returns the largest difference against it (1 = at the bound)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape and want.size, f"int{bits}: shapes {got.shape} and {want.shape}"
    groups = want.reshape(*want.shape[:-1], -1, group)
    step = np.ptp(groups, axis=-1) / (2**bits - 1)
    u = UNIT_ROUNDOFF["float16"]
    steps = step * (1 + 2.0 ** (1 - bits) + 2 * u) if to_grid else step / 2
    allowed = steps + (4 if to_grid else 2) * u * np.abs(groups).max(axis=-1)
    diff = np.abs(got - want).reshape(groups.shape).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = float(np.where(diff == 0, 0.0, diff / allowed).max())
    assert ratio <= 1, f"int{bits}, groups of {group}: off by {diff.max():.3g}, {ratio:.1f}x the bound (tolerance.py)"
    return ratio
