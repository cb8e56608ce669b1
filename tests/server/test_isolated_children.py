"""Subprocesses import only kvfork's code (issue 33, finding 6): each child kvfork starts, started from a
working folder that holds a `kvfork/`, `server/`, `smg/` and `tools/` package of its own, never imports those."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfork.server.engine.api import Scope
from kvfork.server.generate.grammar import GrammarCompiler, JsonSchema
from kvfork.server.generate.isolated import module_command
from kvfork.tools import cluster


@pytest.fixture
def hostile_folder(tmp_path, monkeypatch) -> Path:
    """The working folder, each of its packages writing a marker file when imported."""
    folder, marker = tmp_path / "work", tmp_path / "imported"
    for package in ("kvfork", "server", "smg", "tools", "runpy", "json"):
        (folder / package).mkdir(parents=True)
        (folder / package / "__init__.py").write_text(
            f"open({str(marker)!r}, 'a').write({package!r} + '\\n')\n")
        (folder / package / "__main__.py").write_text(f"open({str(marker)!r}, 'a').write('main\\n')\n")
    (folder / "server" / "grammar_worker.py").write_text(f"open({str(marker)!r}, 'a').write('worker\\n')\n")
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PYTHONPATH", str(folder))  # isolated mode ignores it too
    return marker


async def test_the_grammar_worker_runs_kvforks_code(hostile_folder, tiny_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    grammars = GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=30.0, child_env=os.environ)
    try:
        assert await grammars.compile(JsonSchema({"type": "integer"}), Scope()) is not None
    finally:
        grammars.close()
    assert not hostile_folder.exists()


def test_a_replica_command_runs_kvforks_code(hostile_folder, tiny_model_dir):
    p = cluster.plan(["--model", tiny_model_dir("llama")])
    replica = p.replicas[0]
    head = replica[:replica.index("--model")]  # the replica's command, its flags swapped for --help
    done = subprocess.run([*head, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--kv-events-endpoint" in done.stdout
    assert not hostile_folder.exists()


def test_the_gateway_launcher_runs_the_installed_smg(hostile_folder):
    pytest.importorskip("smg")
    done = subprocess.run([sys.executable, "-I", "-c", cluster.SMG_LAUNCH], input=json.dumps(["--version"]) + "\n",
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip()
    assert not hostile_folder.exists()


@pytest.mark.parametrize("module", ["kvfork.tools.hostile", "kvfork.server.cli"])
def test_tool_children_run_kvforks_code(hostile_folder, module):
    done = subprocess.run(module_command(module, "--help"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not hostile_folder.exists()


def test_the_marker_would_have_been_written_by_a_plain_child(hostile_folder):
    """The folder is hostile indeed: a plain `python -m kvfork.server` started from it runs its code."""
    subprocess.run([sys.executable, "-m", "kvfork.server", "--help"], capture_output=True, timeout=120)
    assert "kvfork" in hostile_folder.read_text()



def test_the_grammar_worker_gets_no_key(monkeypatch):
    """The grammar worker serves no request: it is started without KVFORK_API_KEY and KVFORK_METRICS_KEY."""
    from kvfork.server.common.state import child_environment
    from kvfork.server.generate import grammar

    monkeypatch.setenv("KVFORK_API_KEY", "tenant-secret")
    monkeypatch.setenv("KVFORK_METRICS_KEY", "metrics-secret")
    monkeypatch.setenv("KVFORK_HOME", "/kept")
    started = []

    def popen(argv, **kwargs):
        started.append(kwargs.get("env"))
        raise OSError("not started in this test")

    monkeypatch.setattr(grammar.subprocess, "Popen", popen)
    with pytest.raises(OSError):
        grammar.CompileProcess(lambda: {}, child_environment())._start()
    env = started[0]
    assert env is not None and env.get("KVFORK_HOME") == "/kept"
    assert "KVFORK_API_KEY" not in env and "KVFORK_METRICS_KEY" not in env
