"""`kvfork clients --install`: every npm package as kvfork's lockfile pins it, no dependency's install script run,
then the pinned clients' own install steps alone (npm itself is not run here: its command lines are read)."""

import json
import subprocess

import pytest

from kvfork.tools.clients import run
from kvfork.tools.clients.clients import CLIENTS


def test_the_shipped_lockfile_pins_the_clients_and_their_whole_trees():
    manifest = json.loads(run.LOCKFILE.with_name("package.json").read_text())
    lock = json.loads(run.LOCKFILE.read_text())
    pinned = {c.package: c.version for c in CLIENTS.values()}
    assert manifest["dependencies"] == lock["packages"][""]["dependencies"] == pinned
    assert manifest["allowScripts"] == dict.fromkeys(run.scripted(list(CLIENTS)), True)  # at the lockfile's versions
    for package, version in pinned.items():
        assert lock["packages"][f"node_modules/{package}"]["version"] == version
    for path, entry in lock["packages"].items():  # a platform's optional build may lack its hash (docs/agents.md)
        assert not path or entry.get("integrity", "").startswith("sha512-") or entry["optional"], path
        assert not path or entry["version"], path


@pytest.mark.parametrize("names", [list(CLIENTS), ["codex"]])
def test_install_is_npm_ci_without_scripts_then_the_clients_own_steps(tmp_path, monkeypatch, names):
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path))
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kwargs: ran.append(argv))
    run.install(names)
    folder = tmp_path / "clients"
    assert (folder / "package-lock.json").read_bytes() == run.LOCKFILE.read_bytes()
    ci, *rest = ran
    assert ci[:3] == ["npm", "ci", "--ignore-scripts"] and str(folder) in ci
    own = [CLIENTS[n].package for n in names if n != "codex"]  # Codex has no install step of its own
    assert rest == ([["npm", "rebuild", "--prefix", str(folder), *own]] if own else [])
