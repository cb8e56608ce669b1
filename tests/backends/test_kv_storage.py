"""KV state stored as --kv-cache-dtype says on the torch backend (backends/torch/kv_storage.py): what a
row holds and costs, the head sizes refused, and every reuse path (a clone by reference, a clone that
prefills the rest, a saved state, a verify pass rolled back) answering as the session that wrote the
rows, at each storage. The tiny models' heads are 64 wide here: groups of 64 divide them."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import backend_fixtures
from backend_fixtures import assert_greedy_close, continue_greedy, fresh, lent, prompt, release_all
from kvfork.backends.base import KVStorage, KVStorageRefused
from kvfork.backends.torch import attention, kv, kv_storage
from kvfork.backends.torch.backend import TorchBackend
from tiny_models import write_model
from tolerance import Kind, assert_arrays_close, assert_grouped_close

DEVICE = os.environ.get("KVFORK_DEVICE", "cpu")
STORED = ("float16", "bfloat16", "fp8", "int8", "int4")
WIDE_HEADS = dict(head_dim=64)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """arch -> a tiny model folder whose heads are 64 wide (written once per module)."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = str(write_model(tmp_path_factory.mktemp(f"wide-{arch}"), arch, **WIDE_HEADS))
        return made[arch]

    return get


def load(folder: str, dtype: str, group: int = 64) -> TorchBackend:
    b = TorchBackend(DEVICE)
    b.set_kv_storage(KVStorage.named(dtype, group))
    return backend_fixtures.load(b, folder)


@pytest.mark.parametrize("bits,group", [(8, 32), (8, 64), (4, 64), (4, 128)])
def test_a_grouped_row_decodes_within_half_a_step_of_what_was_written(bits, group):
    x = torch.randn(2, 300, 128) * torch.linspace(0.1, 30, 128)  # groups of very different ranges
    x[0, 5, 7] = 400.0  # an outlier widens its own group only
    storage = kv_storage.Grouped(bits, group, 128, torch.float32)
    stored = storage.encode(x)
    assert stored.dtype == torch.uint8 and stored.shape == (2, 300, 128 * bits // 8 + 4 * (128 // group))
    back = storage.decode(stored)
    assert_grouped_close(back.numpy(), x.numpy(), bits=bits, group=group)
    assert torch.equal(storage.decode(stored[:, 100:200]), back[:, 100:200])  # a slice of rows decodes alone


@pytest.mark.parametrize("n", [16, 64, 128])
def test_the_key_rotation_is_orthogonal_and_keeps_every_query_key_product(n):
    h = kv_storage.hadamard(n)
    assert torch.equal(h, h.T) and set((h * n**0.5).abs().unique().tolist()) == {1.0}
    assert_arrays_close(h @ h.T, torch.eye(n, dtype=torch.float64), kind=Kind.FORMS, reductions=[n])
    storage = kv_storage.Grouped(4, 16, n, torch.float32, rotates_keys=True)
    q, k = torch.randn(3, 5, n), torch.randn(3, 7, n)
    rotated = storage.queries(q) @ (k @ storage.rotation).transpose(1, 2)
    assert_arrays_close(rotated, q @ k.transpose(1, 2), kind=Kind.FORMS, reductions=[n, n, n])


def test_rotated_int4_keys_attend_closer_to_full_precision_than_unrotated_ones_with_outlier_channels():
    """Keys with a few channels 20x the others (as real models' keys have): unrotated, those channels set
    their groups' scales and the rest of each group rounds to a level or two; rotated, the outliers are
    spread over the head. The attention output (values stored alike) is measured against full precision."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, 512, 64, generator=gen)
    k[:, :, [3, 17, 40, 58]] *= 20.0
    q, v = torch.randn(9, 1, 64, generator=gen), torch.randn(3, 512, 64, generator=gen)
    full = attention.decode_runs(q, [(k, v)], 0.125, kv_storage.Plain(torch.float32, torch.float32))

    def error(storage) -> float:
        runs = [storage.encode_kv(k, v)]
        return float((attention.decode_runs(storage.queries(q), runs, 0.125, storage) - full).norm() / full.norm())

    unrotated = error(kv_storage.Grouped(4, 64, 64, torch.float32))
    rotated = error(kv_storage.storage_for(KVStorage("int4", 64), torch.float32, 64))
    assert rotated < unrotated / 2, (rotated, unrotated)


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 64), (4, 32)])
def test_attention_reads_the_integers_as_the_dequantized_rows_say_and_alike_in_any_runs(bits, group):
    """A decode row's scores and values computed from the integers, scales and biases (no dequantized copy)
    equal the products over the decoded rows; and a clone reading the same rows in two runs (the shared
    blocks, then its own) gets exactly the output of the session reading them in one."""
    gen = torch.Generator().manual_seed(1)
    storage = kv_storage.Grouped(bits, group, 64, torch.float32)
    n = 2 * kv.PIECE_TOKENS + 300  # pieces, whole blocks and a partial one
    k, v = storage.encode(torch.randn(3, n, 64, generator=gen)), storage.encode(torch.randn(3, n, 64, generator=gen))
    q, w = torch.randn(3, 3, 64, generator=gen), torch.rand(3, 2, 3, n // 2, generator=gen)
    assert_arrays_close(storage.scores(q, k), q @ storage.decode(k).transpose(1, 2), kind=Kind.FORMS,
                        reductions=[64])
    halves = v[:, : n // 2 * 2].unflatten(1, (2, n // 2))
    decoded = storage.decode(halves)
    want = w @ decoded
    # read from the integers, a value is sum_t w_t scale_t q_t plus sum_t w_t bias_t, each far larger than the
    # value: the sums' roundings are relative to those terms (the sum's condition), not to the value
    bias = storage.scales(halves)[1].repeat_interleave(group, -1)
    terms = w @ ((decoded - bias).abs() + bias.abs())
    assert_arrays_close(storage.weighted(w, halves), want, kind=Kind.FORMS, reductions=[n // 2],
                        condition=float(terms.max() / want.abs().max()))
    one, lse = attention.partial(q, [(k, v)], 0.125, storage)
    cut = 3 * kv.BLOCK_TOKENS
    two, lse_two = attention.partial(q, [(k[:, :cut], v[:, :cut]), (k[:, cut:], v[:, cut:])], 0.125, storage)
    assert torch.equal(one, two) and torch.equal(lse, lse_two)


@pytest.mark.parametrize("dtype", ["auto", *STORED])
def test_a_pass_encodes_each_row_as_it_would_alone(dtype):
    """Attention encodes a pass's rows in one call (Storage.encode_kv with the rows): each row's stored bytes
    are those it gets alone, int4's rotated keys too (a product's rounding depends on its shape)."""
    gen = torch.Generator().manual_seed(4)
    storage = kv_storage.storage_for(KVStorage.named(dtype), torch.float32, 64)
    k, v = 3 * torch.randn(3, 40, 64, generator=gen), torch.randn(3, 40, 64, generator=gen)
    rows = [slice(0, 1), slice(1, 2), slice(2, 30), slice(30, 40)]
    keys, values = storage.encode_kv(k, v, rows)
    for row in rows:
        alone_keys, alone_values = storage.encode_kv(k[:, row], v[:, row])
        assert torch.equal(keys[:, row], alone_keys) and torch.equal(values[:, row], alone_values)


@pytest.mark.parametrize("dtype", ["auto", "int8", "int4"])
@pytest.mark.parametrize("gathered", [True, False])
def test_a_cascade_gives_each_row_what_it_reads_alone(dtype, gathered, monkeypatch):
    """Decode rows sharing a store's leading blocks (a session reading them in its one run, a clone holding
    fewer of them, a clone of a grown clone with more than GATHERED_TOKENS of its own keys): the shared blocks
    read once for the group, each row's own keys in one padded batch (gathered) or alone, each row's output
    within the bound of what it reads alone."""
    gen = torch.Generator().manual_seed(3)
    storage = kv_storage.storage_for(KVStorage.named(dtype), torch.float32, 64)
    B = kv.BLOCK_TOKENS

    def stored(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = torch.randn(2, 3, n, 64, generator=gen)
        return storage.encode(keys), storage.encode(values)

    k, v = stored(3 * B + 40)  # the session's one run: 3 blocks and 40 keys, its new one last
    rows = [[(k, v)], [(k[:, :3 * B], v[:, :3 * B]), stored(17)], [(k[:, :2 * B], v[:, :2 * B]), stored(B + 5)],
            [(k[:, :3 * B], v[:, :3 * B]), stored(B), stored(attention.GATHERED_TOKENS + 3)]]
    shared = min(kv.shareable(runs) for runs in rows)
    assert shared == 2 * B
    if not gathered:
        monkeypatch.setattr(attention, "GATHERED_TOKENS", 0)
    q = torch.randn(9, len(rows), 64, generator=gen)
    spans = [slice(r, r + 1) for r in range(len(rows))]
    got = attention.cascade(q, spans, rows, shared, 0.125, storage)
    for r, runs in enumerate(rows):
        n = sum(key.shape[1] for key, _ in runs)
        alone = attention.attend(q[:, spans[r]], runs, n - 1, 0, None, 0.125, storage)
        assert got[r].shape == alone.shape == (1, 9, 64)
        assert_arrays_close(got[r], alone, kind=Kind.BLOCKS, reductions=[n, n])


@pytest.mark.parametrize("dtype,row", [("auto", 256), ("float16", 128), ("bfloat16", 128), ("fp8", 64),
                                       ("int8", 64 + 4), ("int4", 32 + 4)])
def test_the_budget_prices_the_rows_as_stored(wide_model_dir, dtype, row):
    """Bytes per token: 2 layers x keys and values x 2 KV heads x one row (scales and biases included);
    the backend's own count is KVCost's, exactly, for a session and its clone."""
    b = load(wide_model_dir("llama"), dtype)
    assert b.info.kv.full_bytes_per_token == 2 * 2 * 2 * row
    assert dict(b.info.kv_token_bytes) == {"float32": 2048, "float16": 1024, "bfloat16": 1024, "fp8": 512,
                                           "int8 (groups of 64)": 544, "int4 (groups of 64, rotated keys)": 288}
    donor, _ = fresh(b, prompt(700, seed=1))
    clone = b.clone(donor, 600)
    cost = b.info.kv
    assert b.session_bytes(donor) == cost.bytes_for(700)
    assert b.session_bytes(clone) == cost.bytes_for(600, shared=cost.shared(600), start=600)
    release_all(b, donor, clone)


def test_a_head_size_the_group_does_not_divide_is_refused_at_load(tiny_model_dir, wide_model_dir):
    with pytest.raises(KVStorageRefused, match="head size 16 is not a multiple of --kv-group-size 32"):
        load(tiny_model_dir("llama"), "int8", 32)
    with pytest.raises(KVStorageRefused, match="head size 64 is not a multiple of --kv-group-size 128"):
        load(wide_model_dir("llama"), "int4", 128)
    assert load(tiny_model_dir("llama"), "float16").info.kv_dtype == "float16"  # floats take any head
    with pytest.raises(KVStorageRefused, match="head size 96 is not a power of two, which its keys' Hadamard"):
        kv_storage.storage_for(KVStorage("int4", 32), torch.float32, 96)
    assert kv_storage.storage_for(KVStorage("int8", 32), torch.float32, 96).rotation is None  # int8: no rotation
    with pytest.raises(KVStorageRefused, match="unknown --kv-cache-dtype 'int3'"):
        KVStorage.named("int3")
    assert KVStorage.named("int4_per_token_head") == KVStorage("int4")


@pytest.fixture(params=STORED)
def stored(request, wide_model_dir):
    """(arch, a loaded backend storing KV as the param says); llama and gemma3 (sliding rings)."""
    arch = "gemma3" if request.param in ("fp8", "int4") else "llama"
    for b in lent(request, ("torch-kv", arch, request.param), lambda: load(wide_model_dir(arch), request.param)):
        yield arch, b


def test_every_reuse_path_answers_as_the_session_that_wrote_the_rows(stored):
    """A clone at the end, a clone that prefills the rest (llama: a ring no longer holds its start), a saved
    state imported, and a verify pass rolled back: the same greedy tokens as the session itself."""
    arch, b = stored
    tokens = prompt(600, seed=2)
    donor, logits = fresh(b, tokens)
    clone, saved = b.clone(donor, 600), b.export_state(donor)
    layer = saved.layers[-1]
    assert layer.arrays[0].dtype == np.dtype(np.uint16 if b.info.kv_dtype == "bfloat16" else
                                             np.float16 if b.info.kv_dtype == "float16" else np.uint8)
    restored = b.import_state(saved)
    want = continue_greedy(b, donor, logits, 8)
    assert_greedy_close(b, continue_greedy(b, clone, logits, 8), want, Kind.CLONE, context=608)
    assert_greedy_close(b, continue_greedy(b, restored, logits, 8), want, Kind.DISK, context=608)
    if arch == "llama":  # a prefix cache hit: whole blocks shared, the rest prefilled
        early = b.clone(restored, 520)
        again = b.prefill([early], [tokens[520:]])
        assert_greedy_close(b, continue_greedy(b, early, again, 8), want, Kind.CLONE, context=608)
        release_all(b, early)
    drafted, (first, *rest) = b.open_session(), want[0]
    b.prefill([drafted], [tokens])
    verified = b.verify([drafted], [[first, *rest[:2], 7]], [4])  # the last draft is wrong
    b.truncate(drafted, 603)
    assert_greedy_close(b, continue_greedy(b, drafted, verified[2:3], 5), (want[0][3:], want[1][3:]), Kind.CLONE,
                        context=608)
    release_all(b, donor, clone, restored, drafted)
