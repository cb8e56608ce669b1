"""Batch-invariant attention (--batch-invariant): a query's output is the same bits in every pass.

The kernels beneath attention sum in an order that depends on the shapes a pass gives them, so the same
position computed in a prefill chunk, in a decode row or beside other rows differs in its last bits, and a
quantized storage can turn that into a whole step of its grid (docs/kv-budget.md, "Exact reuse on every model").
Here every product is given shapes that do not depend on the pass:

- a row's keys are read in blocks of BLOCK_TOKENS aligned to position 0, the last padded with zeros, and each
  block's scores are one product of its keys (the rows) by the queries (the columns): MKL's batched products
  give a column the same sums whatever columns, and however many, stand beside it, if there are at least
  LEAST_COLUMNS (zeros make up the rest); the rows are what change them. `unordered_products` checks that at
  load on the CPU the daemon runs on;
- one maximum over every block (exact in any order), each block's weighted values by one product, and its sum
  of weights and the blocks' sums added by halves (`halved`), in an order no kernel chooses;
- a key after a query's position weighs exactly zero, so the blocks a query does not see add nothing.

So a query gets the same bits in a prefill chunk of any length, in a decode row, in any batch, over keys in
any runs, and beside the other decode rows that read their shared leading blocks together (`together`).

Where kv_reading.c reads the stored rows (int8 and int4 on the CPU), `in_place` reads every pass through it
instead: the kernel's orders are its own, fixed per key and per block, so no product's shape matters. A decode
step then reads the integers where they lie, in a third to a half of the products' step, and a prefill chunk takes
about as long as theirs (docs/kv-budget.md, "What it costs").
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from kvfork.backends.torch.kv import BLOCK_TOKENS, PIECE_TOKENS, Segments, own_runs, pieces, shareable
from kvfork.backends.torch.kv_storage import (LEAST_COLUMNS, Grouped, Storage, at_least_columns, batched_product,
                                             zero_padded)

# Column counts `unordered_products` tries: LEAST_COLUMNS up to past COLUMNS, since the decode rows that read
# shared blocks together (`together`) give one product all their columns
PROBED_COLUMNS = (LEAST_COLUMNS, LEAST_COLUMNS + 1, 23, 32, 47, 64, 100, 255, 256, 300, 769)

# Query columns (a query of one head) one product reads at once: its scores are this many columns for each key
# a block holds, so the working memory stays bounded (8 MiB at 8,000 keys)
COLUMNS = 256

# Bytes of scores `in_place` holds at once: fewer columns a pass where a row's keys are many (each column reads
# its keys alone there, so how many pass together changes no bits)
SCORE_BYTES = 32 << 20


def attend(q: torch.Tensor, written: Sequence[tuple[Segments, int | None]], spans: Sequence[slice],
           starts: Sequence[int], scale: float, storage: Storage) -> torch.Tensor:
    """Every row of a varlen batch: queries [heads, tokens, head_dim] (row i at spans[i], positions from
    starts[i]) over its runs of stored keys and values (`written[i]`, from position 0). Decode rows whose first
    run is the same store (clones of one prefix, and the session they were cloned from) read its whole blocks
    together. Returns [tokens, heads, head_dim]."""
    out: list[torch.Tensor | None] = [None] * len(written)
    read = in_place if reads_in_place(storage) else ordered
    groups: dict[int, list[int]] = {}
    for i, ((runs, _), span) in enumerate(zip(written, spans)):
        if span.stop - span.start == 1 and read is ordered:
            groups.setdefault(runs[0][0].data_ptr(), []).append(i)
    for group in groups.values():
        shared = min(shareable(written[i][0]) for i in group)
        if len(group) > 1 and shared:
            rows = together(torch.stack([q[:, spans[i].start] for i in group], 1), [written[i][0] for i in group],
                            [starts[i] for i in group], shared, scale, storage)
            for i, row in zip(group, rows):
                out[i] = row
    for i, ((runs, _), span, start) in enumerate(zip(written, spans, starts)):
        if out[i] is None:
            out[i] = read(q[:, span], runs, start, scale, storage)
    return torch.cat(out)  # type: ignore[arg-type]


def reads_in_place(storage: Storage) -> bool:
    """Whether kv_reading.c reads the stored rows (int8 and int4 on the CPU, where it builds): `in_place`."""
    return storage.kernel is not None


def reading_name(storage: Storage) -> str:
    """What names a saved state's reading where its bits depend on it (a batch-invariant storage's: `in_place`'s
    are not `ordered`'s), so the disk tier keeps each one's files apart."""
    return ", rows read in place" if storage.invariant and reads_in_place(storage) else ""


def in_place(q: torch.Tensor, runs: Segments, start: int, scale: float, storage: Storage) -> torch.Tensor:
    """`ordered`'s output, read by kv_reading.c where the rows lie: its score of a key for a query is one order
    of operations whatever queries and keys a call is given, and so is its sum of a block's weighted values
    (blocks from each run's start, a block boundary), so each column reads the keys it may see, with no floor of
    columns, no whole blocks and no decoded copy; the sums of a block's weights and of the blocks are `halved`.
    Returns [n, heads, head_dim]."""
    assert isinstance(storage, Grouped)  # the kernel reads Grouped's rows (`reads_in_place`)
    heads, n, head_dim = q.shape
    kv_heads = runs[0][0].shape[0]
    group = heads // kv_heads
    queries = by_key_head(q * scale, kv_heads)  # column c: the query at position start + c // group
    out = q.new_empty(kv_heads, n * group, head_dim)
    at_once = max(1, min(COLUMNS, SCORE_BYTES // (4 * kv_heads * (start + n))))
    for first in range(0, n * group, at_once):
        columns = queries[:, first:first + at_once]
        c = columns.shape[1]
        positions = start + torch.arange(first, first + c, device=q.device) // group
        seen = first_keys(runs, int(positions[-1]) + 1)
        scores = joined([storage.scores(columns, k) for k, _ in seen], -1)  # [kv_heads, c, keys]
        hidden = int(positions[0]) + 1  # the first key some column does not see
        scores[..., hidden:].masked_fill_(torch.arange(hidden, scores.shape[-1], device=q.device) > positions[:, None],
                                          -math.inf)
        weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        sums, weight_sums, at = [], [], 0
        for _, v in seen:
            run = storage.block_and_weight_sums(weights[..., at:at + v.shape[1]], v, BLOCK_TOKENS)
            sums.append(run[0])
            weight_sums.append(run[1])
            at += v.shape[1]
        total = halved(joined(weight_sums, 1), 1)[:, 0, :, None]  # [kv_heads, c, 1]
        out[:, first:first + c] = halved(joined(sums, 1), 1)[:, 0] / total
    return out.view(kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, heads, head_dim).to(q.dtype)


def joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The runs' parts as one tensor along `dim`: the only one as it is (a copy of a row's scores costs as much
    as reading them)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def first_keys(runs: Segments, count: int) -> Segments:
    """The runs' first `count` keys and values, in runs."""
    return list(zip(first_blocks([k for k, _ in runs], count), first_blocks([v for _, v in runs], count)))


def ordered(q: torch.Tensor, runs: Segments, start: int, scale: float, storage: Storage) -> torch.Tensor:
    """One row's queries [heads, n, head_dim] at positions [start, start + n) over its runs (start + n keys
    and values as `storage` holds them, the first at position 0), COLUMNS at a time. Returns [n, heads,
    head_dim]."""
    heads, n, head_dim = q.shape
    kv_heads = runs[0][0].shape[0]
    group = heads // kv_heads
    k_blocks, v_blocks = in_blocks(runs, storage)
    queries = by_key_head(q * scale, kv_heads)  # column c: the query at position start + c // group
    out = q.new_empty(kv_heads, n * group, head_dim)
    for first in range(0, n * group, COLUMNS):
        columns = at_least_columns(queries[:, first:first + COLUMNS], 1)
        c, width = min(COLUMNS, n * group - first), columns.shape[1]
        # a padding column takes the last query's position
        positions = start + torch.arange(first, first + width, device=q.device).clamp_max_(first + c - 1) // group
        seen = int(positions[-1]) // BLOCK_TOKENS + 1  # the blocks holding a key some column sees
        scores = hide_after(block_scores(columns, first_blocks(k_blocks, seen)), positions, 0)
        weights = scores.sub_(scores.amax(dim=(1, 2), keepdim=True)).exp_()
        out[:, first:first + c] = added(block_sums(weights, first_blocks(v_blocks, seen)))[:, :c]
    return out.view(kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, heads, head_dim).to(q.dtype)


def together(q: torch.Tensor, row_runs: Sequence[Segments], starts: Sequence[int], shared: int, scale: float,
             storage: Storage) -> list[torch.Tensor]:
    """Decode rows (one query each, q [heads, rows, head_dim]) whose first runs hold the same `shared` leading
    keys (whole blocks): those blocks' scores and sums for every row's columns in one product each, each row's
    own keys after them alone. Each column gets the same products as `ordered` gives it. Returns [1, heads,
    head_dim] per row."""
    heads, rows, head_dim = q.shape
    (k, v), kv_heads = row_runs[0][0], row_runs[0][0][0].shape[0]
    group = heads // kv_heads
    queries = (q * scale).view(kv_heads, group, rows, head_dim).transpose(1, 2).reshape(kv_heads, -1, head_dim)
    columns = at_least_columns(queries, 1)  # column c < rows * group: row c // group
    shared_k, shared_v = in_blocks([(k[:, :shared], v[:, :shared])], storage)
    shared_scores = block_scores(columns, shared_k)  # every row sees every shared key
    own, tops = [], []
    for r, runs in enumerate(row_runs):
        own_k, own_v = in_blocks(own_runs(runs, shared), storage)
        mine = slice(r * group, (r + 1) * group)
        own_columns = at_least_columns(columns[:, mine], 1)
        positions = torch.full((own_columns.shape[1],), starts[r], device=q.device)
        scores = hide_after(block_scores(own_columns, own_k), positions, shared)
        top = scores.amax(dim=(1, 2), keepdim=True)
        top[..., :group] = torch.maximum(top[..., :group], shared_scores[..., mine].amax(dim=(1, 2), keepdim=True))
        own.append(block_sums(scores.sub_(top).exp_(), own_v)[..., :group])
        tops.append(top[..., :group])
    shared_sums = block_sums(shared_scores.sub_(at_least_columns(torch.cat(tops, -1))).exp_(), shared_v)
    out = []
    for r, own_sums in enumerate(own):
        per_block = torch.cat((shared_sums[..., r * group:(r + 1) * group], own_sums), 1)
        out.append(added(per_block).reshape(1, heads, head_dim).to(q.dtype))
    return out


def by_key_head(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [heads, n, head_dim] as each key head's columns [kv_heads, n * group, head_dim], position-major: column
    c is the query at c // group of the group's head c % group."""
    heads, n, head_dim = q.shape
    return q.view(kv_heads, heads // kv_heads, n, head_dim).transpose(1, 2).reshape(kv_heads, -1, head_dim)


def block_scores(columns: torch.Tensor, k_blocks: list[torch.Tensor]) -> torch.Tensor:
    """Each key head's columns [kv_heads, c, head_dim], LEAST_COLUMNS or more, against its keys in blocks:
    [kv_heads, blocks, BLOCK_TOKENS, c]."""
    kv_heads, c, head_dim = columns.shape
    columns = columns.transpose(1, 2)
    scores = columns.new_empty(kv_heads, sum(k.shape[1] for k in k_blocks), BLOCK_TOKENS, c)
    at = 0
    for k in k_blocks:
        for h in range(kv_heads):
            scores[h, at:at + k.shape[1]] = batched_product(k[h], columns[h].expand(k.shape[1], head_dim, c))
        at += k.shape[1]
    return scores


def hide_after(scores: torch.Tensor, positions: torch.Tensor, first_key: int) -> torch.Tensor:
    """Scores [kv_heads, blocks, BLOCK_TOKENS, c] of keys from position `first_key` (a block boundary) with
    -inf where a key comes after its column's position (`positions` [c]), in place."""
    blocks = scores.shape[1]
    first = max(int(positions.min()) - first_key, 0) // BLOCK_TOKENS  # blocks before it every column sees whole
    keys = torch.arange(first_key + first * BLOCK_TOKENS, first_key + blocks * BLOCK_TOKENS, device=scores.device)
    scores[:, first:].masked_fill_(keys.view(blocks - first, BLOCK_TOKENS, 1) > positions, -math.inf)
    return scores


def block_sums(weights: torch.Tensor, v_blocks: list[torch.Tensor]) -> torch.Tensor:
    """Weights [kv_heads, blocks, BLOCK_TOKENS, c] of values in blocks: each block's weighted values and its sum
    of weights, [kv_heads, blocks, head_dim + 1, c]."""
    kv_heads, blocks, _, c = weights.shape
    head_dim = v_blocks[0].shape[-1]
    sums = weights.new_empty(kv_heads, blocks, head_dim + 1, c)
    at = 0
    for v in v_blocks:
        for h in range(kv_heads):
            weighted = batched_product(v[h].transpose(1, 2), weights[h, at:at + v.shape[1]])
            sums[h, at:at + v.shape[1], :head_dim] = weighted
        at += v.shape[1]
    sums[:, :, head_dim:] = halved(weights, 2)
    return sums


def added(per_block: torch.Tensor) -> torch.Tensor:
    """The blocks' weighted values and sums of weights [kv_heads, blocks, head_dim + 1, c] added (`halved`) and
    divided: the output [kv_heads, c, head_dim]."""
    total = halved(per_block, 1)[:, 0]
    return (total[:, :-1] / total[:, -1:]).transpose(1, 2)


def halved(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over `dim`, kept as a dim of 1: zero-padded to a power of two, then each half added to the
    other until one is left. Which terms meet is set by their places alone, and zeros after the last term add
    nothing, so a sum is the same bits at any length its zeros give it; no kernel chooses the order (a product
    with a row of ones sums in an order that depends on its columns on some CPUs)."""
    x = zero_padded(x, dim, 1 << (x.shape[dim] - 1).bit_length())
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x


def in_blocks(runs: Segments, storage: Storage) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The runs' keys and values as blocks [kv_heads, blocks, BLOCK_TOKENS, head_dim], in position order, where
    stored in the weights' dtype views of the runs, else decoded a piece (PIECE_TOKENS) at a time; the last block
    zero-padded (a copy of it alone). Only whole blocks: a product's rounding depends on how many rows it is
    given. A run starts at a block boundary, so every block but the last is whole."""
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for k, v in pieces(runs, storage, PIECE_TOKENS):
        for x, out in ((k, keys), (v, values)):
            x = x if storage.exact else storage.decode(x)
            heads, tokens, width = x.shape
            whole, rest = divmod(tokens, BLOCK_TOKENS)
            if whole:
                out.append(x[:, :whole * BLOCK_TOKENS].view(heads, whole, BLOCK_TOKENS, width))
            if rest:
                out.append(zero_padded(x[:, whole * BLOCK_TOKENS:], 1, BLOCK_TOKENS)[:, None])
    return keys, values


def first_blocks(blocks: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """The first `count` entries along dim 1 of tensors that follow each other there: blocks of `in_blocks`'s
    list, or a row's runs of keys."""
    out = []
    for part in blocks:
        if count > 0:
            out.append(part[:, :count])
            count -= out[-1].shape[1]
    return out


def unordered_products(head_dim: int) -> str | None:
    """Why this CPU's products cannot serve the invariant reading, or None: a column must get the same bits in
    a product of any count of columns from LEAST_COLUMNS and wherever it stands among them, for each product
    this reading and the keys' rotation make (a block's keys by queries, a block's values by weights, the
    rotation by tokens). Tried on random values: which order a kernel sums in is chosen by the shapes."""
    generator = torch.Generator().manual_seed(0)
    for rows, inner in ((BLOCK_TOKENS, head_dim), (head_dim, BLOCK_TOKENS), (head_dim, head_dim)):
        a = torch.randn(2, rows, inner, generator=generator)
        column = torch.randn(2, inner, generator=generator)
        first = None
        for n in PROBED_COLUMNS:
            b = torch.randn(2, inner, n, generator=generator)
            for at in sorted({0, n // 2, n - 1}):
                b[:, :, at] = column
                got = batched_product(a, b)[:, :, at]
                if first is None:
                    first = got
                elif not torch.equal(got, first):
                    return (f"this CPU's matrix products sum a column of a [{rows}, {inner}] product in another order "
                            f"at {n} columns than at {LEAST_COLUMNS}")
    return None
