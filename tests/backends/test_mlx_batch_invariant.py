"""--batch-invariant on the MLX backend (ordered.py): a position's keys and values, so its stored rows and the
logits after them, are bit for bit the same in every pass that computes it: alone, beside other rows of the
decode batch, in other prefill chunks, after a clone, by decode, in a verify row. A quantized storage turns a
last-bit difference into a step of its grid, so this is what makes reuse on = off exact there.

The model has the default model's widths (tiny_models.REAL_WIDTHS) with random weights and two layers: the BLAS's
order of summation changes with the shapes a pass gives it, which the tiny models' 64-wide layers hide."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

import mlx.core as mx  # noqa: E402

import backend_fixtures  # noqa: E402
from kvfork.backends import kv_reading  # noqa: E402
from kvfork.backends.base import KVStorage, KVStorageRefused  # noqa: E402
from kvfork.backends.mlx import kv_storage, ordered  # noqa: E402
from kvfork.backends.mlx.backend import MLXBackend  # noqa: E402
from tiny_models import REAL_WIDTHS, write_model  # noqa: E402

PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, 250, 300)]
OTHER = [int(t) for t in np.random.default_rng(4).integers(1, 250, 170)]
STEPS = 6


@pytest.fixture(autouse=True)
def kernel():
    """The mode reads the rows through kv_reading.c, which these tests need built."""
    if kv_reading.library() is None:
        pytest.skip("kv_reading.c does not build here (no cc, or a CPU it is not written for)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model(tmp_path_factory.mktemp("real-widths"), "llama", **REAL_WIDTHS))


def load(folder: str, dtype: str, invariant: bool = True) -> MLXBackend:
    b = MLXBackend()
    b.set_kv_storage(KVStorage.named(dtype))
    b.set_batch_invariant(invariant)
    return backend_fixtures.load(b, folder)


def paths(b: MLXBackend):
    """name -> (the session holding PROMPT, its last logits, the sessions decoding beside it)."""
    alone = b.open_session()
    yield "alone", alone, b.prefill([alone], [PROMPT])[0], ()
    row, other = b.open_session(), b.open_session()
    logits = b.prefill([row, other], [PROMPT, OTHER])[0]
    yield "beside a shorter row of the decode batch", row, logits, (other,)
    chunked = b.open_session()
    b.prefill([chunked], [PROMPT[:128]])
    yield "in two chunks", chunked, b.prefill([chunked], [PROMPT[128:]])[0], ()
    donor = b.open_session()
    b.prefill([donor], [PROMPT[:270]])
    clone = b.clone(donor, 200)
    yield "a clone of a longer prompt", clone, b.prefill([clone], [PROMPT[200:]])[0], (donor,)
    decoded, longer = b.open_session(), b.open_session()
    b.prefill([decoded, longer], [PROMPT[:290], OTHER + OTHER])
    for token in PROMPT[290:-1]:
        b.decode([decoded, longer], [token, 5])
    yield "the last tokens decoded beside a longer row", decoded, b.decode([decoded, longer], [PROMPT[-1], 5])[0], ()
    verified, beside = b.open_session(), b.open_session()
    b.prefill([verified, beside], [PROMPT[:280], OTHER])
    logits = b.verify([verified, beside], [PROMPT[280:], [9, 10, 11]], [1, 3])[0]
    yield "the last tokens verified beside a row of three", verified, logits, ()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_every_path_to_a_position_gives_the_same_bits(model_dir, dtype):
    b = load(model_dir, dtype)
    backend_fixtures.assert_every_path_gives_the_same_bits(b, paths(b), STEPS)


def test_without_it_the_paths_differ(model_dir):
    """The check above can fail: the same paths at int8 without --batch-invariant give other bits somewhere."""
    b = load(model_dir, "int8", invariant=False)
    with pytest.raises(AssertionError, match="step"):
        backend_fixtures.assert_every_path_gives_the_same_bits(b, paths(b), STEPS)


@pytest.mark.parametrize("family,dtype,refused", [
    ("llama", "auto", "--kv-cache-dtype int8 or int4"),
    ("llama", "float16", "--kv-cache-dtype int8 or int4"),
    ("gemma3", "int8", "not for sliding-window or recurrent layers"),
])
def test_what_it_cannot_compute_so_is_refused(tmp_path, family, dtype, refused):
    folder = write_model(tmp_path, family, head_dim=64)
    with pytest.raises(KVStorageRefused, match=f"--batch-invariant: .*{refused}"):
        load(str(folder), dtype)


def test_without_the_kernel_it_is_refused(model_dir, monkeypatch):
    monkeypatch.setattr(kv_storage, "in_place_kernel", lambda dims: None)  # as where kv_reading.c cannot be built
    with pytest.raises(KVStorageRefused, match=r"--batch-invariant: .*\(kv_reading.c, which needs a C compiler\)"):
        load(model_dir, "int8")


def test_a_cpu_whose_products_sum_a_token_by_its_place_is_refused(model_dir, monkeypatch):
    real = ordered.products

    def by_place(weight, x):  # the tokens after the first summed in float64: the same values, other roundings
        y = real(weight, x)
        if x.shape[0] < 2:
            return y
        wide = (x[1:].astype(mx.float64) @ weight.astype(mx.float64).T).astype(y.dtype)
        return mx.concatenate([y[:1], wide])

    monkeypatch.setattr(ordered, "products", by_place)
    with pytest.raises(KVStorageRefused, match=r"--batch-invariant: this CPU's products give .* at place \d+ of"):
        load(model_dir, "int8")
