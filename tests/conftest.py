"""Shared fixtures: tiny random model folders, made once per test run."""

from __future__ import annotations

import pytest

from tiny_models import ARCHS, write_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A function arch -> folder; each arch is written once per run."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = str(write_model(tmp_path_factory.mktemp(arch), arch))
        return made[arch]

    return get


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory):
    """A function (arch, layout) -> folder of a tiny hybrid model (tiny_hybrid_models.py), written
    once per run; the same weights in every layout."""
    from tiny_hybrid_models import write_hybrid_model

    made: dict[tuple[str, str], str] = {}

    def get(arch: str, layout: str = "hf") -> str:
        if (arch, layout) not in made:
            made[arch, layout] = str(write_hybrid_model(tmp_path_factory.mktemp(f"{arch}-{layout}"), arch, layout))
        return made[arch, layout]

    return get


@pytest.fixture(autouse=True)
def kvfork_home(tmp_path_factory, monkeypatch):
    """Every test gets its own KVFORK_HOME: the disk tier never writes under the user's."""
    home = tmp_path_factory.mktemp("kvfork_home")
    monkeypatch.setenv("KVFORK_HOME", str(home))
    return home
