"""Attention of one row (one session's new tokens) over the keys its layer holds.

One call per row and layer, reading the session's own head-major KV buffers as
they are: a padded batch of rows would first copy every row's KV into one
tensor, which costs more than the attention on the CPU (tools/decode_bench.py,
`layout` section). Everything else in a pass runs over all rows' tokens at once.

A row's keys come in runs (kv.py: the blocks it shares, then its own store). One
run, the common case, is read as it is. Several:
- a decode row reads each run where it lies: its scores against every run, one
  softmax over them all, and each run's values weighted by its part (no copy of
  the keys; the scores are a few floats per key);
- decode rows whose first run starts in the same store (clones of one prefix, and
  the session they were cloned from, whose one run holds those blocks) read the
  whole blocks all of them hold once per step for the group (cascade: one product
  of all their queries against the shared keys, merged with each row's own keys
  by log-sum-exp), measured faster than row by row at 8 sessions sharing 4k
  (docs/benchmarks.md); the rows' own keys, where short (a clone's few tokens
  past the prefix), are read in one padded batch of the group's rows, since a
  read's fixed costs, not its bytes, are then its time. FlashInfer's cascade
  kernels are not wired in yet, so CUDA runs this plain path too;
- a prefill chunk attends over the runs joined into one buffer (`join`), a copy
  of the session's keys measured against the chunk's forward time
  (tools/clone_bench.py, `prefill` section). The buffer is reused across layers
  and steps: a fresh tensor per layer faults its pages in first, which measured
  several times the copy itself on the CPU.

A row's runs hold keys and values as its layer stores them (kv_storage.py). Stored in the weights'
dtype, they are read as they are; otherwise (--kv-cache-dtype) a decode row reads them a piece
(`PIECE_TOKENS` positions from the run's start, which is a block boundary) at a time inside its loop
over runs, through the storage's `scores` and `block_sums` (int8 and int4: from the integers, with no
dequantized copy; on the CPU by kv_reading.c where it builds), and a prefill chunk decodes them a piece at a
time into its joined buffer (`decode_into`): never the whole cache at once. The values' products are summed
per block of `BLOCK_TOKENS` in one reduction, so a clone, reading the same stored rows in more runs, computes
the same output as the session that wrote them. Where the storage rotates keys
(int4), `attend_rows` rotates the queries once for all rows; values are stored unrotated, so the output
is read as it is.

Under --batch-invariant (`Storage.invariant`) every row is read by ordered_attention.py instead, whose
products have the same shapes in every pass, so a position's output is the same bits on every path.

On CUDA, FlashAttention (`flash_attn`) reads the same buffers through strides
when it imports; otherwise, and on the CPU, torch's SDPA. Both give the same
masks: causal aligned to the last key, and for sliding layers the window. A
prefill row holding an image whose tokens attend each other both ways (Gemma 3,
images.py) takes SDPA with that mask, built for the row.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvfork.backends.torch.cpu_attention import attention_with_lse
from kvfork.backends.torch.images import PlacedImage, image_mask
from kvfork.backends.torch import ordered_attention
from kvfork.backends.torch.kv import BLOCK_TOKENS, PIECE_TOKENS, own_runs, pieces, shareable
from kvfork.backends.torch.kv_storage import Storage, working_memory

Runs = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) as stored, in position order


@functools.cache
def flash_attention():
    """FlashAttention's `flash_attn_func`, or None where it does not import (the CPU, no wheel)."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def window_mask(first_key: int, start: int, n: int, n_keys: int, window: int, device) -> torch.Tensor:
    """Boolean [n, n_keys]: query start+i sees key first_key+j when it is in the past `window` positions."""
    q = torch.arange(start, start + n, device=device)[:, None]
    k = torch.arange(first_key, first_key + n_keys, device=device)[None, :]
    return (k <= q) & (k > q - window)


def attend(q: torch.Tensor, runs: Runs, start: int, first_key: int | None, window: int | None, scale: float,
           storage: Storage, images: Sequence[PlacedImage] = ()) -> torch.Tensor:
    """q: [heads, n, head_dim] for positions [start, start + n); runs: (keys, values) [kv_heads, n_keys,
    width] each as `storage` holds them, in position order, the first key at position `first_key` (None: a
    ring's unordered slots, all visible to the single query); `images`: the row's images whose tokens
    attend each other both ways. Returns [n, heads, head_dim]."""
    if q.shape[1] == 1 and (len(runs) > 1 or not storage.exact):
        return decode_runs(q, runs, scale, storage)
    if len(runs) > 1 or not storage.exact:
        keys, values = join(runs, storage, q)
    else:
        (keys, values), = runs
    if images and q.shape[1] > 1:
        assert first_key is not None  # a chunk's keys are in position order
        mask = image_mask(images, start, q.shape[1], first_key, keys.shape[1], window, q.device)
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    kernel = flash_attention() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
    if kernel is not None:
        return flash(kernel, q, keys, values, window, scale)
    return sdpa(q, keys, values, start, first_key, window, scale)


# (device, dtype, kv_heads, head_dim) -> keys and values buffers [kv_heads, tokens, head_dim]: working
# memory of the one runner thread, like a pass's activations (not KV state, so not in the KV budget)
_joined: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def join(runs: Runs, storage: Storage, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs' keys and values decoded, each as one [kv_heads, tokens, head_dim] view (q's dtype and
    head_dim) of a buffer reused by every later call (read it before the next call)."""
    kv_heads, n = runs[0][0].shape[0], sum(k.shape[1] for k, _ in runs)
    key = (q.device, q.dtype, kv_heads, q.shape[2])
    held = _joined.get(key)
    if held is None or held[0].shape[1] < n:
        shape = (kv_heads, n, q.shape[2])
        held = _joined[key] = (q.new_empty(shape), q.new_empty(shape))
    at = 0
    for k, v in pieces(runs, storage, PIECE_TOKENS):
        storage.decode_into(k, held[0][:, at:at + k.shape[1]])
        storage.decode_into(v, held[1][:, at:at + k.shape[1]])
        at += k.shape[1]
    return held[0][:, :n], held[1][:, :n]


def sdpa(q, keys, values, start, first_key, window, scale) -> torch.Tensor:
    """`attend` through torch's scaled_dot_product_attention: the plain path, on every device."""
    n, n_keys = q.shape[1], keys.shape[1]
    if n == 1:
        mask = None  # one query sees every key its layer returns
    elif window is None and n < n_keys and not q.is_cuda:
        return chunk_after_keys(q, keys, values, scale)
    elif window is None:
        mask = causal_lower_right(n, n_keys)
    else:
        mask = window_mask(first_key, start, n, n_keys, window, q.device)
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def chunk_after_keys(q, keys, values, scale) -> torch.Tensor:
    """A prefill chunk (n queries, the last n of the keys) on the CPU, in two masks a fused kernel takes:
    the keys before the chunk, which every query sees, and the chunk's own keys, causal, merged by the
    log-sum-exp each part returns. A lower-right causal mask over all the keys would reach the kernel as
    a materialized [n, n_keys] bias, measured 3.3x slower at 64k keys (one thread)."""
    heads, n, head_dim = q.shape
    kv_heads, before = keys.shape[0], keys.shape[1] - n
    group = heads // kv_heads
    # every query of a key head's group sees every earlier key: the group's queries as one longer sequence
    seen, lse_seen = attention_with_lse(q.reshape(1, kv_heads, group * n, head_dim), keys[None, :, :before],
                                        values[None, :, :before], False, scale)
    own, lse_own = attention_with_lse(q[None], keys[:, before:].repeat_interleave(group, 0)[None],
                                      values[:, before:].repeat_interleave(group, 0)[None], True, scale)
    seen, lse_seen = seen.reshape(heads, n, head_dim), lse_seen.reshape(heads, n, 1)
    lse_own = lse_own.reshape(heads, n, 1)
    lse = torch.logaddexp(lse_seen, lse_own)
    out = seen * torch.exp(lse_seen - lse) + own[0] * torch.exp(lse_own - lse)
    return out.to(q.dtype).transpose(0, 1)


def flash(kernel, q, keys, values, window, scale) -> torch.Tensor:
    """`attend` through FlashAttention's `kernel` (flash_attn_func), CUDA and 16-bit only."""
    # Token-major views of the head-major buffers: FlashAttention takes any strides but the last.
    # Its causal mask is aligned to the last key, as causal_lower_right; a ring's single query
    # sees all its slots (causal with n = 1 masks nothing), and a chunk's window is (W - 1, 0).
    out = kernel(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                 softmax_scale=scale, causal=True, window_size=(window - 1, 0) if window else (-1, -1))
    return out[0]


def partial(grouped: torch.Tensor, runs: Runs, scale: float, storage: Storage, valid: torch.Tensor | None = None):
    """Grouped queries [kv_heads, q, head_dim] over keys in runs read where they lie: the scores against
    each run (in pieces of PIECE_TOKENS, read from the stored rows, where stored otherwise than in the weights'
    dtype), one softmax over all of them (float32), then each block's values weighted by its part, the blocks'
    sums added in one reduction. A block of BLOCK_TOKENS is the unit of that sum wherever it is read (a run
    starts at a block boundary), so a clone reading the same rows in more runs adds the same terms. `valid`
    (boolean, broadcast against the scores [kv_heads, q, keys]): the keys each query sees, where not all
    (`gather`'s padding). Returns the output [kv_heads, q, head_dim] (float32) and the log-sum-exp of the
    scores [kv_heads, q, 1]."""
    runs = pieces(runs, storage, PIECE_TOKENS)
    read = [storage.scores(grouped, k) for k, _ in runs]
    # the softmax in place: the scores are a fresh tensor, and at a few queries its operations' time is
    # their outputs' pages, not their arithmetic
    scores = (read[0] if len(read) == 1 else torch.cat(read, dim=-1)).float().mul_(scale)
    if valid is not None:
        scores.masked_fill_(~valid, -math.inf)
    top = scores.amax(dim=-1, keepdim=True)
    total = scores.sub_(top).exp_().sum(dim=-1, keepdim=True)
    weights = scores.div_(total).to(grouped.dtype)
    parts, at = [], 0
    for _, v in runs:
        parts.append(storage.block_sums(weights[..., at:at + v.shape[1]], v,
                                        v.shape[1] if storage.exact else BLOCK_TOKENS))
        at += v.shape[1]
    return torch.cat(parts, dim=1).sum(1), total.log_().add_(top)


def decode_runs(q: torch.Tensor, runs: Runs, scale: float, storage: Storage) -> torch.Tensor:
    """One query ([heads, 1, head_dim]) over keys in runs, read where they lie. Grouped-query
    heads share their key head as SDPA's enable_gqa does (head h reads h // group)."""
    kv_heads, head_dim = runs[0][0].shape[0], q.shape[-1]
    out, _ = partial(q.reshape(kv_heads, -1, head_dim), runs, scale, storage)
    return out.to(q.dtype).reshape(1, -1, head_dim)


CASCADE = True  # decode rows sharing a first run read it together (tools/clone_bench.py measures both)

# A row of a cascade whose own keys (those past the shared ones) are at most this many is read with the
# group's other such rows in one padded batch (`gather`), where the fixed costs of a read, not its bytes, are
# the time; a longer one is read where it lies, alone (docs/benchmarks.md, "KV storage")
GATHERED_TOKENS = 4 * BLOCK_TOKENS


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, states: Sequence, starts: Sequence[int],
                spans: Sequence[slice], window: int | None, scale: float,
                images: Sequence[Sequence[PlacedImage]] | None = None) -> torch.Tensor:
    """A layer's attention for every row of a varlen batch: each row's new keys and values
    (head-major [kv_heads, tokens, head_dim], the rows' end to end) encoded as stored and written to its
    layer state (`states[i].update`, from `starts[i]`), then its queries ([heads, tokens, head_dim]) attended over
    what that state returns; `images[i]`: row i's images whose tokens attend each other both ways; a
    batch-invariant storage reads every row through ordered_attention.py instead. Returns [tokens, heads, head_dim].

    Cascade: decode rows whose first run starts in the same store (clones of one prefix, and the
    session they were cloned from) read the leading blocks all of them hold once for the group: one
    product of all their queries against the shared keys, merged with each row's own keys by log-sum-exp."""
    storage = states[0].storage  # one storage for every session of a backend
    k, v = storage.encode_kv(k, v, spans)  # every row's at once: a decode step's fixed costs paid once
    written = [state.update(k[:, span], v[:, span], start) for state, span, start in zip(states, spans, starts)]
    q = storage.queries(q)  # in the keys' stored basis: rotated where they are (kv_storage.py)
    if storage.invariant:
        return ordered_attention.attend(q, written, spans, starts, scale, storage)
    out: list[torch.Tensor | None] = [None] * len(written)
    groups: dict[int, list[int]] = {}
    for i, ((runs, first_key), span) in enumerate(zip(written, spans)):
        if CASCADE and span.stop - span.start == 1 and first_key is not None:
            groups.setdefault(runs[0][0].data_ptr(), []).append(i)
    for group in groups.values():
        shared = min(shareable(written[i][0]) for i in group)
        if len(group) > 1 and shared:
            for i, o in zip(group, cascade(q, [spans[i] for i in group], [written[i][0] for i in group], shared,
                                           scale, storage)):
                out[i] = o
    for i, ((runs, first_key), span, start) in enumerate(zip(written, spans, starts)):
        if out[i] is None:
            out[i] = attend(q[:, span], runs, start, first_key, window, scale, storage, images[i] if images else ())
    return torch.cat(out)  # type: ignore[arg-type]


def cascade(q: torch.Tensor, spans: Sequence[slice], row_runs: list[Runs], shared: int, scale: float,
            storage: Storage) -> list[torch.Tensor]:
    """Decode rows (one query each, at `spans` of q) whose first runs hold the same `shared` leading keys
    (whole blocks): those read once for all of them, each row's keys after them (`own`) read in one padded
    batch with the other rows' where short (`GATHERED_TOKENS`), else alone, merged by log-sum-exp. Returns
    [1, heads, head_dim] per row."""
    (first_k, first_v), kv_heads, head_dim = row_runs[0][0], row_runs[0][0][0].shape[0], q.shape[-1]
    rows = len(spans)
    queries = torch.stack([q[:, span][:, 0] for span in spans])  # [rows, heads, head_dim]
    grouped = queries.view(rows, kv_heads, -1, head_dim).transpose(0, 1).reshape(kv_heads, -1, head_dim)
    together, lse_together = partial(grouped, [(first_k[:, :shared], first_v[:, :shared])], scale, storage)
    group = together.shape[1] // rows
    by_row = grouped.view(kv_heads, rows, group, head_dim)
    own = [own_runs(runs, shared) for runs in row_runs]
    short = [r for r in range(rows) if sum(k.shape[1] for k, _ in own[r]) <= GATHERED_TOKENS]
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if short:
        keys, values, valid = gather([own[r] for r in short])
        read, lse = partial(by_row[:, short].reshape(-1, group, head_dim), [(keys, values)], scale, storage, valid)
        parts.update(zip(short, zip(read.view(kv_heads, len(short), group, head_dim).unbind(1),
                                    lse.view(kv_heads, len(short), group, 1).unbind(1))))
    for r in range(rows):
        if r not in parts:
            parts[r] = partial(by_row[:, r], own[r], scale, storage)
    own_out = torch.stack([parts[r][0] for r in range(rows)], 1).view_as(together)
    lse_own = torch.stack([parts[r][1] for r in range(rows)], 1).view_as(lse_together)
    lse = torch.logaddexp(lse_together, lse_own)
    merged = (together * torch.exp(lse_together - lse) + own_out * torch.exp(lse_own - lse)).to(q.dtype)
    return list(merged.view(kv_heads, rows, group, head_dim).transpose(0, 1).reshape(rows, 1, -1, head_dim).unbind(0))


# (device, dtype) -> working memory of the runner thread holding rows' runs side by side (`gather`)
_gathered: dict[tuple, torch.Tensor] = {}


def gather(rows: list[Runs]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's runs end to end as stored, the rows side by side, zero-padded to the longest row: keys and
    values [kv_heads * rows, tokens, width] (row r of key head h at h * rows + r: a view of working memory,
    read it before the next call) and which positions each row holds, [kv_heads * rows, 1, tokens]. Zeros
    decode to zero in every storage, so a padding position weighs nothing."""
    (k0, _), n = rows[0][0], len(rows)
    lengths = [sum(k.shape[1] for k, _ in runs) for runs in rows]
    tokens = max(lengths)
    both = working_memory(_gathered, (2, k0.shape[0], n, tokens, k0.shape[2]), k0.dtype, k0.device)
    for r, runs in enumerate(rows):
        at = 0
        for k, v in runs:
            both[0, :, r, at:at + k.shape[1]].copy_(k)
            both[1, :, r, at:at + k.shape[1]].copy_(v)
            at += k.shape[1]
        both[:, :, r, at:].zero_()
    held_positions = torch.arange(tokens, device=k0.device) < torch.tensor(lengths, device=k0.device)[:, None]
    valid = held_positions.expand(k0.shape[0], n, tokens).reshape(-1, 1, tokens)
    keys, values = both.flatten(1, 2).unbind(0)
    return keys, values, valid
