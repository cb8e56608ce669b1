"""kv_reading.c reading torch's int8 and int4 rows on the CPU (backends/torch/integer_reading.py): the scores
and each block's weighted values it computes from the stored integers are torch's products over the same rows,
within float32 rounding, for every storage, head size and query count the attention hands it, read where the
rows lie (views of larger stores); its bits do not depend on its threads; and where it cannot be built the
storage reads the rows through torch's products. Its build and load: test_kv_reading.py."""

from __future__ import annotations

import shutil

import pytest
import torch

import arm_kernel
import backend_fixtures
from backend_fixtures import assert_greedy_close, continue_greedy, prompt
from kvfork.backends import kv_reading
from kvfork.backends.base import KVStorage
from kvfork.backends.device_memory import cpu_flags
from kvfork.backends.torch import attention, integer_reading, kv, kv_storage, ordered_attention
from kvfork.backends.torch.backend import TorchBackend
from tiny_models import write_model
from tolerance import Kind, assert_arrays_close


@pytest.fixture(scope="module", params=["native", "avx2", "arm"])
def kernel(request, tmp_path_factory) -> integer_reading.Kernel:
    """The kernel built for this CPU; for AVX2 alone (8 lanes to a vector, not AVX-512's 16) where this CPU runs
    AVX2; and for 64-bit Arm (4 lanes) under an emulator where a cross compiler and qemu are installed."""
    if request.param == "native":
        built = integer_reading.kernel()
        if built is None:
            pytest.skip("kv_reading.c does not build here (no cc, or a CPU it is not written for)")
        return built
    if request.param == "arm":
        emulated = arm_kernel.library(tmp_path_factory.mktemp("arm"))
        if emulated is None:
            pytest.skip(arm_kernel.MISSING)
        return integer_reading.Kernel(emulated)  # type: ignore[arg-type]
    cc = shutil.which("cc")
    if cc is None or "avx2" not in cpu_flags():
        pytest.skip("no cc, or a CPU without AVX2")
    flags = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in kv_reading.FLAGS)
    return integer_reading.Kernel(kv_reading.loaded(kv_reading.build(cc, tmp_path_factory.mktemp("avx2"), flags)))


def stored_rows(storage: kv_storage.Grouped, heads: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of `heads` key heads and t tokens as a view inside a larger store (another head before them,
    tokens after them), as a run of a session's blocks is."""
    x = torch.randn(heads + 1, t + 40, storage.head_dim, generator=gen) * torch.linspace(0.2, 4, storage.head_dim)
    return storage.encode(x)[1:, :t]


@pytest.mark.numeric
@pytest.mark.parametrize("bits,group,head_dim", [(8, 64, 64), (8, 32, 64), (8, 128, 128), (4, 64, 64),
                                                 (4, 32, 128), (4, 128, 256)])
@pytest.mark.parametrize("queries", [1, 3, 11])
def test_the_kernel_reads_the_rows_as_torchs_products_do(kernel, bits, group, head_dim, queries):
    gen = torch.Generator().manual_seed(bits * 1000 + group + head_dim + queries)
    with_kernel = kv_storage.Grouped(bits, group, head_dim, torch.float32, kernel=kernel)
    products = kv_storage.Grouped(bits, group, head_dim, torch.float32)
    t = 3 * kv.BLOCK_TOKENS + 77  # whole blocks and a partial one, tiles of the kernel's threads
    keys, values = stored_rows(with_kernel, 3, t, gen), stored_rows(with_kernel, 3, t, gen)
    q = torch.randn(3, queries, head_dim, generator=gen)
    assert_arrays_close(with_kernel.scores(q, keys), products.scores(q, keys), kind=Kind.FORMS,
                        reductions=[head_dim])
    # weights as the attention hands them: a slice of the scores' softmax across the runs
    w = torch.softmax(torch.randn(3, queries, t + 100, generator=gen), -1)[..., 50:50 + t]
    got, want = with_kernel.block_sums(w, values, kv.BLOCK_TOKENS), products.block_sums(w, values, kv.BLOCK_TOKENS)
    assert got.shape == want.shape == (3, 4, queries, head_dim)
    # each value is sum_t w_t scale_t q_t plus sum_t w_t bias_t, rounded relative to those terms
    decoded = products.decode(values)
    bias = products.scales(values)[1].repeat_interleave(group, -1)
    terms = w @ ((decoded - bias).abs() + bias.abs())
    assert_arrays_close(got.sum(1), want.sum(1), kind=Kind.FORMS, reductions=[kv.BLOCK_TOKENS],
                        condition=float(terms.max() / want.sum(1).abs().max()))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_clone_reading_the_rows_in_runs_gets_the_bits_of_one_run(kernel, bits):
    """A clone reads the blocks it shares and then its own rows: with the kernel, the output and log-sum-exp
    equal those of the session reading the same rows in one run."""
    gen = torch.Generator().manual_seed(bits)
    storage = kv_storage.Grouped(bits, 64, 64, torch.float32, kernel=kernel)
    n = kv.PIECE_TOKENS + 3 * kv.BLOCK_TOKENS + 30
    k, v = stored_rows(storage, 3, n, gen), stored_rows(storage, 3, n, gen)
    q = torch.randn(3, 3, 64, generator=gen)
    one, lse = attention.partial(q, [(k, v)], 0.125, storage)
    cut = 5 * kv.BLOCK_TOKENS
    two, lse_two = attention.partial(q, [(k[:, :cut], v[:, :cut]), (k[:, cut:], v[:, cut:])], 0.125, storage)
    assert torch.equal(one, two) and torch.equal(lse, lse_two)


@pytest.mark.parametrize("bits,group,head_dim", [(8, 64, 64), (8, 32, 128), (4, 64, 64), (4, 32, 128)])
def test_a_querys_bits_do_not_depend_on_the_queries_beside_it(kernel, bits, group, head_dim):
    """The kernel reads a key once for many queries (SHARED_FROM or more) and once for each otherwise: a query's
    scores and a block's weighted values are the same bits alone, among a few and among many, wherever it
    stands; and each block's sum of weights is ordered_attention.halved's (the exact mode's reading)."""
    gen = torch.Generator().manual_seed(bits + group + head_dim)
    storage = kv_storage.Grouped(bits, group, head_dim, torch.float32, kernel=kernel)
    t = 2 * kv.BLOCK_TOKENS + 37  # keys in tiles of LANES and a remainder
    keys, values = stored_rows(storage, 2, t, gen), stored_rows(storage, 2, t, gen)
    q, w = torch.randn(2, 70, head_dim, generator=gen), torch.rand(2, 70, t, generator=gen)
    blocks = -(-t // kv.BLOCK_TOKENS)
    for n in (1, 3, 4, 17, 70):  # 70: more than a thread's QUERY_CHUNK
        for at in sorted({0, n - 1}):
            order = torch.arange(n).roll(at)  # query 0 at `at`
            chosen_q, chosen_w = q[:, order], w[:, order]
            scores = kernel.scores(chosen_q, keys, bits, group)
            weight_sums = torch.empty(2, blocks, n)
            sums = kernel.block_sums(chosen_w, values, bits, group, head_dim, kv.BLOCK_TOKENS, weight_sums)
            assert torch.equal(scores[:, at], kernel.scores(q[:, :1], keys, bits, group)[:, 0])
            assert torch.equal(sums[:, :, at], kernel.block_sums(w[:, :1], values, bits, group, head_dim,
                                                                 kv.BLOCK_TOKENS)[:, :, 0])
            in_blocks = torch.nn.functional.pad(chosen_w, (0, blocks * kv.BLOCK_TOKENS - t))
            halved = ordered_attention.halved(in_blocks.view(2, n, blocks, kv.BLOCK_TOKENS), 3)[..., 0]
            assert torch.equal(weight_sums, halved.transpose(1, 2))


def test_the_kernels_bits_do_not_depend_on_its_threads(kernel, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    storage = kv_storage.Grouped(8, 64, 64, torch.float32, kernel=kernel)
    keys, values = stored_rows(storage, 3, 2000, gen), stored_rows(storage, 3, 2000, gen)
    q, w = torch.randn(3, 3, 64, generator=gen), torch.rand(3, 3, 2000, generator=gen)
    read = {}
    for threads in (1, 2, 3):
        monkeypatch.setattr(kernel, "threads", lambda threads=threads: threads)
        read[threads] = kernel.scores(q, keys, 8, 64), kernel.block_sums(w, values, 8, 64, 64, kv.BLOCK_TOKENS)
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(read[1], read[threads]))


def test_the_storage_reads_through_torchs_products_where_the_kernel_cannot_be_built(monkeypatch):
    """Without the kernel (kv_reading.library is None: test_kv_reading.py) the storage reads the rows through
    torch's products."""
    monkeypatch.setattr(integer_reading.kv_reading, "library", lambda: None)
    assert integer_reading.kernel.__wrapped__() is None
    monkeypatch.setattr(integer_reading, "kernel", lambda: None)
    storage = kv_storage.storage_for(KVStorage("int8", 64), torch.float32, 64, torch.device("cpu"))
    assert isinstance(storage, kv_storage.Grouped) and storage.kernel is None
    gen = torch.Generator().manual_seed(3)
    k = storage.encode(torch.randn(3, 300, 64, generator=gen))
    q = torch.randn(3, 2, 64, generator=gen)
    assert_arrays_close(storage.scores(q, k), q @ storage.decode(k).transpose(1, 2), kind=Kind.FORMS,
                        reductions=[64])


@pytest.mark.numeric
@pytest.mark.parametrize("bits,group,head_dim", [(8, 64, 64), (8, 32, 128), (4, 64, 64), (4, 32, 256)])
def test_the_kernel_decodes_the_rows_as_torchs_operations_do(kernel, bits, group, head_dim):
    """A prefill chunk's reading: the rows decoded into a view of the joined buffer."""
    gen = torch.Generator().manual_seed(bits + group + head_dim)
    with_kernel = kv_storage.Grouped(bits, group, head_dim, torch.float32, kernel=kernel)
    stored = stored_rows(with_kernel, 3, kv.BLOCK_TOKENS + 50, gen)
    buffer = torch.full((3, kv.BLOCK_TOKENS + 100, head_dim), float("nan"))
    with_kernel.decode_into(stored, buffer[:, 20:20 + stored.shape[1]])
    want = kv_storage.Grouped(bits, group, head_dim, torch.float32).decode(stored)
    # x = q * scale + bias, rounded relative to its terms
    bias = with_kernel.scales(stored)[1].repeat_interleave(group, -1)
    terms = (want - bias).abs() + bias.abs()
    assert_arrays_close(buffer[:, 20:20 + stored.shape[1]], want, kind=Kind.FORMS, reductions=[2],
                        condition=float(terms.max() / want.abs().max()))
    assert buffer[:, :20].isnan().all() and buffer[:, 20 + stored.shape[1]:].isnan().all()


@pytest.mark.numeric
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_cpu_backend_reads_its_rows_through_the_kernel(dtype, tmp_path):
    """The backend's load hands its storage the kernel on the CPU, and a session's greedy decode there answers as
    the same backend reading through torch's products."""
    if integer_reading.kernel() is None:
        pytest.skip("kv_reading.c does not build here (no cc, or a CPU it is not written for)")
    folder = str(write_model(tmp_path, "llama", head_dim=64))
    greedy = {}
    for reading in ("kernel", "products"):
        b = TorchBackend("cpu")
        b.set_kv_storage(KVStorage.named(dtype))
        if reading == "products":
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(integer_reading, "kernel", lambda: None)
                backend_fixtures.load(b, folder)
            assert b.pool.storage.kernel is None
        else:
            backend_fixtures.load(b, folder)
            assert b.pool.storage.kernel is integer_reading.kernel()
        s = b.open_session()
        tokens = prompt(300, seed=5)
        greedy[reading] = continue_greedy(b, s, b.prefill([s], [tokens]), 12)
    assert_greedy_close(b, greedy["kernel"], greedy["products"], kind=Kind.FORMS, context=312)
