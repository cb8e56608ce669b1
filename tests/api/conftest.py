"""Fixtures of the HTTP tests: a keys file, and a disk tier the cost model reads back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfork.server.engine.policy import placement, restore


@pytest.fixture
def keys_file(request, tmp_path) -> str:
    """An --api-keys-file holding the test module's KEYS."""
    path = tmp_path / "keys"
    path.write_text(request.module.KEYS)
    return str(path)


@pytest.fixture
def disk_beats_prefill(monkeypatch):
    """A tiny model prefills faster than anything loads: simulate the case the tier is for (a model whose
    prefill is dear), so the cost model restores. tests/engine/test_disk_tier.py tests its choice both ways."""
    def choose(upto, nbytes, memory, rates, prefilling):
        return restore.choose_restore(upto, nbytes, memory, replace(rates, prefill_tps=1.0), prefilling)

    monkeypatch.setattr(placement, "choose_restore", choose)
