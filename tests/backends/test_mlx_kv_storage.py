"""KV state stored as --kv-cache-dtype says on the MLX backend (backends/mlx/kv_storage.py): what a row
holds and costs, the head sizes and storages refused, int4's rotated keys, and every reuse path (a clone
from the decode batch, a clone that prefills the rest, a saved state, a verify pass rolled back)
answering as the session that wrote the rows, at each storage. The tiny models' heads are 64 wide here:
MLX groups 32, 64 or 128 elements, so heads of 16 cannot be quantized."""

from __future__ import annotations

import numpy as np
import pytest

import arm_kernel
import backend_fixtures
from backend_fixtures import assert_close, assert_greedy_close, continue_greedy, fresh, lent, prompt, release_all
from tiny_hybrid_models import write_hybrid_model
from tiny_models import write_model
from tolerance import Kind, assert_arrays_close, assert_grouped_close

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models import base as mlx_lm_base  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from kvfork.backends import kv_reading  # noqa: E402
from kvfork.backends.base import KVStorage, KVStorageRefused  # noqa: E402
from kvfork.backends.mlx import cpu_attention, kv_storage  # noqa: E402
from kvfork.backends.mlx.backend import MLXBackend  # noqa: E402

STORED = ("float16", "bfloat16", "int8", "int4")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """(arch, head size) -> a tiny model folder whose heads are that wide (written once per module)."""
    made: dict[tuple[str, int], str] = {}

    def get(arch: str, head_dim: int = 64) -> str:
        if (arch, head_dim) not in made:
            folder = tmp_path_factory.mktemp(f"wide-{arch}-{head_dim}")
            made[arch, head_dim] = str(write_model(folder, arch, head_dim=head_dim))
        return made[arch, head_dim]

    return get


def load(folder: str, dtype: str, group: int = 64) -> MLXBackend:
    b = MLXBackend()
    b.set_kv_storage(KVStorage.named(dtype, group))
    return backend_fixtures.load(b, folder)


@pytest.mark.parametrize("bits,group", [(8, 32), (8, 64), (4, 64), (4, 128)])
def test_a_grouped_row_is_read_within_a_step_of_what_was_written(bits, group):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 300, 128)) * np.linspace(0.1, 30, 128)  # groups of very different ranges
    x[0, 0, 5, 7] = 400.0  # an outlier widens its own group only
    storage = kv_storage.QuantizedRows(bits, group, mx.float32, integer_attention=True)
    stored = storage.encode(mx.array(x, mx.float32))
    assert stored.dtype == mx.uint32 and stored.shape == (1, 2, 300, 128 * bits // 32 + 128 // group)
    assert storage.row_bytes(128) == stored[..., :1, :].nbytes // 2
    q, scales, biases = storage.parts(stored)
    assert scales.dtype == mx.float32
    back = np.array(mx.dequantize(q, scales, biases, group_size=group, bits=bits))
    assert_grouped_close(back, x, bits=bits, group=group, to_grid=True)
    part = storage.parts(stored[:, :, 100:200])  # a slice of rows is read alone
    assert np.array_equal(np.array(mx.dequantize(*part, group_size=group, bits=bits)), back[:, :, 100:200])
    for compute in (mx.float32, mx.bfloat16):  # the CPU's reading: mx.dequantize's values, bit for bit
        on_cpu = kv_storage.QuantizedRows(bits, group, compute, integer_attention=False)
        rows = stored[:, :, 100:200]
        want = mx.dequantize(*on_cpu.parts(rows), group_size=group, bits=bits)
        read = on_cpu.attended(rows, kv_storage.Reading.ROWS)
        assert read.dtype == compute and mx.array_equal(read, want).item()


def test_the_rotation_is_the_normalised_sylvester_hadamard_matrix_and_keeps_q_dot_k():
    n = 64
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(n)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, n)).astype(np.float32)
    rotated = kv_storage.RotatedRoPE(lambda a, offset=0: a)(mx.array(x))
    assert_arrays_close(np.array(rotated), x @ h, kind=Kind.FORMS, reductions=(n,))
    np.testing.assert_array_equal(h @ h.T, np.eye(n))  # entries of +-1/8: every product and sum exact
    assert_arrays_close(np.array(rotated @ rotated.T), x @ x.T, kind=Kind.FORMS, reductions=(n, n))


def test_rotated_int4_keys_score_closer_to_full_precision_than_unrotated_on_an_outlier_channel():
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((1, 1, 256, 64)).astype(np.float32)
    keys[..., 3] *= 40.0  # one channel of outliers, as real keys have
    queries = rng.standard_normal((1, 1, 8, 64)).astype(np.float32)
    want = queries @ keys.swapaxes(-1, -2)
    storage = kv_storage.QuantizedRows(4, 64, mx.float32, integer_attention=True)

    def scores(rotate: bool) -> np.ndarray:
        turn = (lambda a: mx.hadamard_transform(a, scale=64**-0.5)) if rotate else (lambda a: a)
        k = storage.parts(storage.encode(turn(mx.array(keys))))
        return np.array(mx.quantized_matmul(turn(mx.array(queries)), *k, transpose=True, group_size=64, bits=4))

    plain, rotated = np.abs(scores(False) - want).mean(), np.abs(scores(True) - want).mean()
    assert rotated < plain / 2


@pytest.mark.parametrize("dtype,row", [("auto", 256), ("float16", 128), ("bfloat16", 128), ("int8", 64 + 4),
                                       ("int4", 32 + 4)])
def test_the_budget_prices_the_rows_as_stored(wide_model_dir, dtype, row):
    """Bytes per token: 2 layers x keys and values x 2 KV heads x one row (scales and biases included);
    the backend's own count is KVCost's for a session, a clone of it and the decode batch's row."""
    b = load(wide_model_dir("llama"), dtype)
    assert b.info.kv.full_bytes_per_token == 2 * 2 * 2 * row
    named = {KVStorage(name).label("float32"): size for name, size in (("auto", 2048), ("float16", 1024),
                                                                      ("bfloat16", 1024), ("int8", 544), ("int4", 288))}
    assert dict(b.info.kv_token_bytes) == named
    donor, logits = fresh(b, prompt(700, seed=1))
    clone = b.clone(donor, 600)
    cost = b.info.kv
    assert b.session_bytes(donor) == cost.bytes_for(700)
    assert b.session_bytes(clone) == cost.bytes_for(600, start=600)
    b.decode([donor], [5])  # a row of the decode batch
    assert b.session_bytes(donor) <= cost.row_bytes(701)
    release_all(b, donor, clone)


def test_what_mlx_or_the_head_size_cannot_take_is_refused_at_load(tiny_model_dir, wide_model_dir):
    with pytest.raises(KVStorageRefused, match="head size 16 is not a multiple of --kv-group-size 32"):
        load(tiny_model_dir("llama"), "int8", 32)
    with pytest.raises(KVStorageRefused, match="head size 64 is not a multiple of --kv-group-size 128"):
        load(wide_model_dir("llama"), "int4", 128)
    with pytest.raises(KVStorageRefused, match="--kv-cache-dtype fp8: MLX has no such storage"):
        load(wide_model_dir("llama"), "fp8")
    with pytest.raises(KVStorageRefused, match="head size 96 is not a power of two, which its keys' Hadamard"):
        load(wide_model_dir("llama", 96), "int4", 32)
    assert load(wide_model_dir("llama", 96), "int8", 32).info.kv_dtype == "int8 (groups of 32)"
    assert load(tiny_model_dir("llama"), "float16").info.kv_dtype == "float16"  # floats take any head


def test_quantized_storage_is_refused_a_model_whose_attention_has_sinks():
    """mlx-lm's quantized attention (a GPU's every pass, the CPU's decode) raises on attention sinks (gpt-oss)."""
    attention = nn.Module()
    attention.sinks = mx.zeros((4,))
    model = nn.Module()
    model.layers = [attention]
    with pytest.raises(KVStorageRefused, match="--kv-cache-dtype int8: this model's attention has sinks"):
        kv_storage.refuse_sinks(model, KVStorage.named("int8"))
    kv_storage.refuse_sinks(nn.Module(), KVStorage.named("int8"))


def kernel_or_skip() -> kv_reading.Library:
    library = kv_reading.library()
    if library is None:
        pytest.skip("kv_reading.c does not build here (no cc, or a CPU it is not written for)")
    return library


@pytest.fixture(scope="module")
def arm_library(tmp_path_factory) -> arm_kernel.EmulatedLibrary:
    emulated = arm_kernel.library(tmp_path_factory.mktemp("arm"))
    if emulated is None:
        pytest.skip(arm_kernel.MISSING)
    return emulated


@pytest.mark.parametrize("bits,group,dim", [(8, 64, 64), (8, 32, 128), (4, 64, 64), (4, 32, 128)])
@pytest.mark.parametrize("reading", ["in place", "in place, Arm", "cast", "cast, 7 keys a span"])
def test_one_query_over_the_stored_rows_agrees_with_attention_over_the_dequantized_rows(bits, group, dim, reading,
                                                                                         monkeypatch, request):
    """The CPU's decode readings (cpu_attention.py: the rows read in place by kv_reading.c, built for this CPU or
    for 64-bit Arm under an emulator, or the integers cast;
    scales and biases applied to scores and weights), one group and several a row, 6 query heads over 2 KV heads,
    a batch of 3 rows two of them left-padded (the boolean mask the batch caches make), an additive mask, and
    mlx-lm's "causal" and None, the rows a slice of a longer store (as a cache holds them), cast at once and 7
    keys at a time (40 keys: the last span shorter): mx.fast.scaled_dot_product_attention's output over the same
    rows dequantized, within the tolerance of two forms of one computation."""
    if reading == "cast, 7 keys a span":
        monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", 3 * 2 * dim * 4 * 7)
    kernel = None
    if reading == "in place":
        kernel = kernel_or_skip()
    elif reading == "in place, Arm":
        kernel = request.getfixturevalue("arm_library")
    rng = np.random.default_rng(5)
    storage = kv_storage.QuantizedRows(bits, group, mx.float32, integer_attention=False, kernel=kernel)
    keys, values = (storage.encode(mx.array(rng.standard_normal((3, 2, 48, dim)) * 3 + 1, mx.float32))[..., :40, :]
                    for _ in range(2))
    queries = mx.array(rng.standard_normal((3, 6, 1, dim)), mx.float32)
    chosen = storage.reading(1, keys, values)
    assert chosen is (kv_storage.Reading.IN_PLACE if kernel else kv_storage.Reading.CAST)
    read = [storage.attended(side, chosen) for side in (keys, values)]
    assert all(isinstance(side, cpu_attention.StoredRows if kernel else cpu_attention.CastIntegers) for side in read)
    padded = (mx.arange(40)[None] >= mx.array([5, 17, 0])[:, None])[:, None, None]
    additive = mx.array(rng.standard_normal((3, 1, 1, 40)), mx.float32)
    for mask in (None, "causal", padded, additive):
        got = cpu_attention.attention(queries, *read, dim**-0.5, mask, group, bits)
        want = mx.fast.scaled_dot_product_attention(queries, storage.dequantized(keys), storage.dequantized(values),
                                                    scale=dim**-0.5, mask=None if isinstance(mask, str) else mask)
        assert got.shape == want.shape and got.dtype == mx.float32
        assert_arrays_close(np.array(got), np.array(want), kind=Kind.FORMS, reductions=(dim, 40, 40))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("decode", ["in place", "cast"])
def test_attention_over_the_integers_and_over_the_dequantized_rows_agree(wide_model_dir, monkeypatch, dtype, decode):
    """The GPU's reading (mx.quantized_matmul over the integers, mlx-lm's quantized attention: the cache has
    `bits`) and the CPU's (prefill over the rows dequantized, then scaled_dot_product_attention; decode over the
    rows read in place by kv_reading.c, or without it the integers cast, which mlx-lm's attention reaches through
    cpu_attention.install: mlx-lm's own quantized attention is never called) of the same stored rows: the same
    logits within the tolerance of two forms of one computation, and the same greedy tokens."""
    if decode == "in place":
        kernel_or_skip()
    else:
        monkeypatch.setattr(kv_storage, "in_place_kernel", lambda dims: None)
    runs, decode_passes = {}, []
    read = cpu_attention.read_in_place if decode == "in place" else cpu_attention.read_cast
    for integers in (True, False):
        monkeypatch.setattr(kv_storage, "attends_integers", lambda integers=integers: integers)
        if not integers:
            monkeypatch.setattr(cpu_attention, "MLX_LM_ATTENTION", None)  # a call would raise
            monkeypatch.setattr(cpu_attention, read.__name__, lambda *args: decode_passes.append(1) or read(*args))
        b = load(wide_model_dir("llama"), dtype)
        assert mlx_lm_base.quantized_scaled_dot_product_attention is cpu_attention.attention
        s, logits = fresh(b, prompt(300, seed=4), chunk=128)
        assert all(hasattr(c, "bits") == integers for c in s.caches)
        runs[integers] = b, logits, continue_greedy(b, s, logits, 6)
        release_all(b, s)
    assert len(decode_passes) == 2 * 6  # 2 layers, 6 decode steps
    (b, on_gpu, gpu_tokens), (_, on_cpu, cpu_tokens) = runs[True], runs[False]
    assert_close(b, on_cpu, on_gpu, Kind.FORMS, context=300)
    assert_greedy_close(b, cpu_tokens, gpu_tokens, Kind.FORMS, context=306)


@pytest.mark.parametrize("bits", [8, 4])
def test_on_the_cpu_decode_reads_the_rows_in_place_and_a_prefill_copy_past_its_bound_as_integers(bits, monkeypatch):
    """A pass's reading is the cache's for that pass: mlx-lm's attention goes to its quantized attention where the
    cache has `bits`. On the CPU a prefill chunk reads the rows dequantized, unless that copy would pass
    DEQUANTIZED_BYTES: then the integers through mx.quantized_matmul, as on a GPU in every pass
    (`attends_integers`); a decode step (one query a row) reads the rows in place through kv_reading.c
    (`StoredRows`), or without it the integers cast (`CastIntegers`), whatever the length."""
    x = mx.array(np.random.default_rng(1).standard_normal((1, 2, 8, 64)), mx.float32)
    for on_gpu in (False, True):
        cache = kv_storage.stored(KVCache(), kv_storage.QuantizedRows(bits, 64, mx.float32, integer_attention=on_gpu))
        keys, _ = cache.update_and_fetch(x[:, :, :5], x[:, :, :5])  # a prefill chunk
        assert hasattr(cache, "bits") == on_gpu and isinstance(keys, tuple) == on_gpu
        keys, _ = cache.update_and_fetch(x[:, :, 5:6], x[:, :, 5:6])  # a decode step
        assert hasattr(cache, "bits") and isinstance(keys, cpu_attention.CastIntegers) != on_gpu
        assert keys[0].shape[-2] == 6  # what was written before is read too
    if kv_reading.library() is not None:
        cache = kv_storage.stored(KVCache(), kv_storage.QuantizedRows(bits, 64, mx.float32, integer_attention=False,
                                                                      kernel=kv_reading.library()))
        cache.update_and_fetch(x[:, :, :5], x[:, :, :5])
        keys, _ = cache.update_and_fetch(x[:, :, 5:6], x[:, :, 5:6])
        assert isinstance(keys, cpu_attention.StoredRows) and keys[0].shape == (1, 2, 6, 64 * bits // 32 + 1)
        assert keys[1] == 64 and keys[2] is kv_reading.library()
    cache = kv_storage.stored(KVCache(), kv_storage.QuantizedRows(bits, 64, mx.float32, integer_attention=False))
    monkeypatch.setattr(kv_storage, "DEQUANTIZED_BYTES", 2 * 2 * 5 * 64 * 4)  # keys and values, 2 heads of 64
    assert not isinstance(cache.update_and_fetch(x[:, :, :5], x[:, :, :5])[0], tuple)  # a copy at the bound
    keys, _ = cache.update_and_fetch(x[:, :, 5:6], x[:, :, 5:6])  # a decode step past it: cast
    assert isinstance(keys, cpu_attention.CastIntegers)
    keys, _ = cache.update_and_fetch(x[:, :, 6:], x[:, :, 6:])  # two queries past it: the integers
    assert type(keys) is tuple and hasattr(cache, "bits")
    assert kv_storage.attends_integers() == (mx.default_device() == mx.gpu)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_loaded_storage_reads_in_place_on_the_cpu_and_a_priced_one_builds_nothing(wide_model_dir, dtype,
                                                                                       monkeypatch):
    """The backend's load hands its caches' storage kv_reading.c on the CPU (a GPU reads the integers in every
    pass); the price table's storages (`storages_bytes`, every dtype at every load) ask for no build."""
    library = kernel_or_skip()
    b = load(wide_model_dir("llama"), dtype)
    s = b.open_session()
    b.prefill([s], [prompt(20, seed=1)])
    assert {c.storage.kernel for c in s.caches} == {None if kv_storage.attends_integers() else library}
    release_all(b, s)
    monkeypatch.setattr(kv_storage.kv_reading, "library", lambda: pytest.fail("a price built the kernel"))
    for name in ("int8", "int4"):
        assert kv_storage.storage_for(KVStorage.named(name), mx.float32, (64, 64)).kernel is None


@pytest.fixture(params=STORED)
def stored(request, wide_model_dir):
    """(arch, a loaded backend storing KV as the param says); llama and gemma3 (sliding rings)."""
    arch = "gemma3" if request.param in ("bfloat16", "int4") else "llama"
    for b in lent(request, ("mlx-kv", arch, request.param), lambda: load(wide_model_dir(arch), request.param)):
        yield arch, b


def test_every_reuse_path_answers_as_the_session_that_wrote_the_rows(stored):
    """A clone of a decoding row, a clone that prefills the rest (llama), a saved state imported, and
    (llama) a verify pass rolled back: the same greedy tokens as the session itself."""
    arch, b = stored
    tokens = prompt(600, seed=2)
    donor, logits = fresh(b, tokens, chunk=256)
    clone, saved = b.clone(donor, 600), b.export_state(donor)
    assert saved.layers[-1].arrays[0].dtype == {"float16": np.float16, "bfloat16": np.uint16}.get(
        b.info.kv_dtype, np.uint32)
    restored = b.import_state(saved)
    want = continue_greedy(b, donor, logits, 10)
    mid = b.clone(donor, 610)  # of a row of the decode batch
    both = b.decode([donor, mid], [5, 5])
    assert_close(b, both[1:], both[:1], Kind.CLONE, context=611)
    assert_greedy_close(b, continue_greedy(b, clone, logits, 10), want, Kind.CLONE, context=610)
    assert_greedy_close(b, continue_greedy(b, restored, logits, 10), want, Kind.DISK, context=610)
    release_all(b, mid)
    if arch == "llama":  # a prefix cache hit: the rest prefilled; speculation's roll-back
        early = b.clone(restored, 520)
        again = b.prefill([early], [tokens[520:]])
        assert_greedy_close(b, continue_greedy(b, early, again, 10), want, Kind.CLONE, context=610)
        drafted, (first, *rest) = b.open_session(), want[0]
        b.prefill([drafted], [tokens])
        verified = b.verify([drafted], [[first, *rest[:2], 7]], [4])  # the last draft is wrong
        b.truncate(drafted, 603)
        assert_greedy_close(b, continue_greedy(b, drafted, verified[2:3], 7), (want[0][3:], want[1][3:]),
                            Kind.CLONE, context=610)
        release_all(b, early, drafted)
    release_all(b, donor, clone, restored)


def test_a_hybrid_keeps_its_recurrent_state_in_full_precision_and_its_attention_quantized(tmp_path):
    """qwen3_next at int4: attention layers store rotated grouped rows, recurrent states stay float32; a clone
    at the position decodes beside its donor as the donor does."""
    b = load(str(write_hybrid_model(tmp_path, "qwen3_next", head_dim=64)), "int4")
    donor, _ = fresh(b, prompt(100, seed=3, vocab=400))
    clone = b.clone(donor, 100)
    kinds = {type(c).__name__: c for c in clone.caches}
    assert set(kinds) == {"StoredKV", "ArraysCache"}
    assert kinds["StoredKV"].keys.dtype == mx.uint32 and kinds["ArraysCache"].cache[-1].dtype == mx.float32
    both = b.decode([donor, clone], [5, 5])
    assert_close(b, both[1:], both[:1], Kind.CLONE, context=101)
    release_all(b, donor, clone)
