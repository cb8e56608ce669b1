"""mlx-lm's private cache members, read in one adapter (backends/mlx/mlx_lm_caches.py): the range of mlx-lm
versions it was checked for is the installed one's and pyproject.toml's, and each member means what the
adapter says, so an mlx-lm upgrade fails here rather than in a clone."""

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
from mlx_lm.models.cache import BatchKVCache, RotatingKVCache  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402

from kvfork.backends.mlx.mlx_lm_caches import (MLX_LM_VERSIONS, forget_last, in_time_order, set_write_index,  # noqa: E402
                                               write_index)

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_mlx_lm_is_one_the_adapter_was_checked_for():
    assert version("mlx-lm") in SpecifierSet(MLX_LM_VERSIONS)
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = next(d for d in dependencies if re.match(r"mlx-lm\b", d))
    assert SpecifierSet(pinned.removeprefix("mlx-lm")) == SpecifierSet(MLX_LM_VERSIONS)


def _positions(array: mx.array) -> list[int]:
    """The position each slot of a [1, 1, slots, 1] array of positions holds."""
    return [int(x) for x in array[0, 0, :, 0].tolist()]


def test_a_rotating_cache_reports_its_write_index_and_its_ring_in_time_order():
    window, cache = 4, RotatingKVCache(max_size=4, keep=0)
    for position in range(6):  # one token at a time, as decode writes: the ring wraps after 4
        step = mx.full((1, 1, 1, 1), float(position))
        cache.update_and_fetch(step, step)
    assert write_index(cache) == 2  # slots 0 and 1 were overwritten by positions 4 and 5
    assert _positions(cache.keys) == [4, 5, 2, 3]
    assert _positions(in_time_order(cache, cache.keys)) == [2, 3, 4, 5]
    ring = RotatingKVCache(max_size=window, keep=0)
    ring.keys = ring.values = mx.array([[[[2.0], [3.0], [4.0], [5.0]]]])
    ring.offset = 6
    set_write_index(ring, window)  # full, in time order: the next write lands on slot 0, the oldest
    ring.update_and_fetch(mx.full((1, 1, 1, 1), 6.0), mx.full((1, 1, 1, 1), 6.0))
    assert _positions(in_time_order(ring, ring.keys)) == [3, 4, 5, 6]


def test_a_batch_cache_reports_where_it_writes_next():
    cache = BatchKVCache(left_padding=[0])
    assert write_index(cache) == 0
    cache.update_and_fetch(mx.zeros((1, 1, 3, 1)), mx.zeros((1, 1, 3, 1)))
    assert write_index(cache) == 3 and write_index(object()) is None


def test_a_batch_cache_forgets_its_rows_last_positions_as_mlx_lm_right_padding_does():
    """forget_last gives what mlx-lm's prepare(right_padding=...) and finalize() give: each row shifted
    right by its count, right-aligned at the write index, the forgotten positions become left padding."""
    ours, theirs = BatchKVCache(left_padding=[1, 0, 2]), BatchKVCache(left_padding=[1, 0, 2])
    step = mx.arange(3 * 6, dtype=mx.float32).reshape(3, 1, 6, 1)
    for cache in (ours, theirs):
        cache.update_and_fetch(step, step)
    forget_last(ours, [2, 0, 3])
    theirs.prepare(right_padding=[2, 0, 3])
    theirs.finalize()
    idx = write_index(ours)
    assert idx == write_index(theirs) == 6
    assert ours.left_padding.tolist() == theirs.left_padding.tolist() == [3, 0, 5]
    assert ours.offset.tolist() == theirs.offset.tolist() == [3, 6, 1]
    for row, pad in enumerate([3, 0, 5]):  # what each row holds after its padding: the same positions
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert a[row, 0, pad:idx, 0].tolist() == b[row, 0, pad:idx, 0].tolist()
