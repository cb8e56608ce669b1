"""--batch-invariant on the torch backend (loading.set_batch_invariant, ordered_attention.py): a position's keys
and values, so its stored rows and the logits after them, are bit for bit the same in every pass that computes
it: alone, beside another row, beside clones of it that read its blocks together, in other prefill chunks, after
a clone, by decode. A quantized storage turns a last-bit difference into a step of its grid, so this is what
makes reuse on = off exact there.

The model has the default model's widths (tiny_models.REAL_WIDTHS) with random weights and two layers: oneDNN's
and MKL's kernels change their order of summation with the shapes a pass gives them, which the tiny models'
64-wide layers hide."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import backend_fixtures
from kvfork.backends.base import KVStorage, KVStorageRefused
from kvfork.backends.torch import integer_reading, kv_storage, ordered_attention
from kvfork.backends.torch.backend import TorchBackend
from kvfork.backends.torch.kv import BLOCK_TOKENS
from tiny_models import REAL_WIDTHS, write_model
from tolerance import Kind, assert_arrays_close
PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, 250, 300)]
OTHER = [int(t) for t in np.random.default_rng(4).integers(1, 250, 170)]
STEPS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model(tmp_path_factory.mktemp("real-widths"), "llama", **REAL_WIDTHS))


def load(folder: str, dtype: str, invariant: bool = True) -> TorchBackend:
    b = TorchBackend("cpu")
    b.set_kv_storage(KVStorage.named(dtype))
    b.set_batch_invariant(invariant)
    return backend_fixtures.load(b, folder)


def paths(b: TorchBackend):
    """name -> (the session holding PROMPT, its last logits, the sessions decoding beside it)."""
    alone = b.open_session()
    yield "alone", alone, b.prefill([alone], [PROMPT])[0], ()
    row, other = b.open_session(), b.open_session()
    yield "beside another row", row, b.prefill([row, other], [PROMPT, OTHER])[0], (other,)
    donor = b.open_session()
    logits = b.prefill([donor], [PROMPT])[0]  # its clones read its first block where it lies, with it
    yield "beside clones of it", donor, logits, (b.clone(donor, len(PROMPT)), b.clone(donor, 280))
    chunked = b.open_session()
    b.prefill([chunked], [PROMPT[:128]])
    yield "in two chunks", chunked, b.prefill([chunked], [PROMPT[128:]])[0], ()
    donor = b.open_session()
    b.prefill([donor], [PROMPT[:270]])
    clone = b.clone(donor, 200)
    yield "a clone of a longer prompt", clone, b.prefill([clone], [PROMPT[200:]])[0], ()
    decoded = b.open_session()
    b.prefill([decoded], [PROMPT[:290]])
    for token in PROMPT[290:-1]:
        b.decode([decoded], [token])
    yield "the last tokens decoded", decoded, b.decode([decoded], [PROMPT[-1]])[0], ()


@pytest.mark.parametrize("dtype", ["auto", "int8", "int4"])
def test_every_path_to_a_position_gives_the_same_bits(model_dir, dtype):
    b = load(model_dir, dtype)
    with torch.inference_mode():
        backend_fixtures.assert_every_path_gives_the_same_bits(b, paths(b), STEPS)


def test_a_model_with_sliding_window_layers_is_refused(tmp_path):
    with pytest.raises(KVStorageRefused, match="--batch-invariant: not for sliding-window layers"):
        load(str(write_model(tmp_path, "gemma3")), "auto")


def test_a_cpu_whose_products_sum_a_column_by_the_column_count_is_refused(model_dir, monkeypatch):
    real = ordered_attention.batched_product

    def by_column_count(a, b):  # sums in float64 from 100 columns: the same values, other roundings
        return real(a.double(), b.double()).float() if b.shape[-1] >= 100 else real(a, b)

    monkeypatch.setattr(ordered_attention, "batched_product", by_column_count)
    with pytest.raises(KVStorageRefused, match=r"--batch-invariant: this CPU's matrix products sum a column .* at 100 "):
        load(model_dir, "auto")


@pytest.mark.numeric
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("start,n", [(0, 300), (517, 1), (700, 40)])
def test_the_kernels_reading_attends_as_the_products_do(bits, start, n):
    """ordered_attention.in_place (kv_reading.c reads the rows) and `ordered` (the rows decoded, MKL's products)
    are two forms of one attention: a prefill chunk's queries and a decode row's, over keys in two runs (a
    clone's), the same within float32 rounding; and `attend` takes the kernel's reading where the storage has
    it."""
    kernel = integer_reading.kernel()
    if kernel is None:
        pytest.skip("kv_reading.c does not build here")
    gen = torch.Generator().manual_seed(bits + start)
    with_kernel = kv_storage.Grouped(bits, 64, 64, torch.float32, kernel=kernel)
    keys, values = (with_kernel.encode(torch.randn(3, start + n, 64, generator=gen) * 2) for _ in range(2))
    cut = 2 * BLOCK_TOKENS if start + n > 2 * BLOCK_TOKENS else start + n
    runs = [(keys[:, :cut], values[:, :cut]), (keys[:, cut:], values[:, cut:])][:1 if cut == start + n else 2]
    q = torch.randn(9, n, 64, generator=gen)
    got = ordered_attention.in_place(q, runs, start, 0.125, with_kernel)
    want = ordered_attention.ordered(q, runs, start, 0.125, kv_storage.Grouped(bits, 64, 64, torch.float32))
    assert_arrays_close(got.numpy(), want.numpy(), kind=Kind.FORMS, reductions=[64, start + n])
    read = ordered_attention.attend(q, [(runs, None)], [slice(0, n)], [start], 0.125, with_kernel)
    assert torch.equal(read, got)


@pytest.mark.parametrize("score_bytes", [1, 4 * 3 * 760 * 7])
def test_the_kernels_reading_holds_fewer_columns_at_once_where_keys_are_many_with_the_same_bits(monkeypatch,
                                                                                               score_bytes):
    """`in_place` bounds its scores' bytes (SCORE_BYTES) by reading fewer query columns a pass, one at a time or
    7 here: each column reads its keys alone, so the output is the same bits."""
    kernel = integer_reading.kernel()
    if kernel is None:
        pytest.skip("kv_reading.c does not build here")
    gen = torch.Generator().manual_seed(1)
    storage = kv_storage.Grouped(8, 64, 64, torch.float32, kernel=kernel)
    keys, values = (storage.encode(torch.randn(3, 760, 64, generator=gen)) for _ in range(2))
    runs = [(keys[:, :512], values[:, :512]), (keys[:, 512:], values[:, 512:])]
    q = torch.randn(9, 60, 64, generator=gen)
    whole = ordered_attention.in_place(q, runs, 700, 0.125, storage)
    monkeypatch.setattr(ordered_attention, "SCORE_BYTES", score_bytes)
    assert torch.equal(ordered_attention.in_place(q, runs, 700, 0.125, storage), whole)


def test_a_state_computed_through_the_kernel_names_its_files_so(model_dir):
    """The disk tier's fingerprint takes the backend's state format: under --batch-invariant the reading that
    computed a state (kv_reading.c's or the products') is part of what its bits depend on."""
    plain = load(model_dir, "int8", invariant=False).state_format
    assert load(model_dir, "auto").state_format == plain == "TorchBackend"
    if integer_reading.kernel() is not None:
        assert load(model_dir, "int8").state_format == "TorchBackend, rows read in place"
