"""Paired mode, the CLI, smoke and peers, with the OpenAI test double started as the daemon.

The double (tests/openai_double.py) takes the daemon's flags, so these run the
tools' real process handling, metrics scraping, reports and exit codes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backends.mlx.blas import find_openblas
from tools import smoke
from tools.bench import main, paired, peers
from tools.bench.serve import ServerProcess

DOUBLE = [sys.executable, str(Path(__file__).with_name("openai_double.py"))]


@pytest.fixture(autouse=True)
def use_double(monkeypatch):
    monkeypatch.setattr(paired, "DAEMON", DOUBLE)


def test_paired_prints_one_table_and_writes_everything(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["paired", "--model", tiny_model_dir("llama"), "--preset", "staggered,burst", "--n", "3",
                 "--prefix-tokens", "150", "--max-tokens", "12", "--threshold", "32", "--logprobs",
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "**staggered**" in printed and "**burst**" in printed and "| on/off |" in printed
    assert "staggered, on vs off: greedy outputs: 0 of 7 differ" in printed  # 3 calls, 2 tails, 2 warm ones
    assert "| tail-only TTFT p50 s | recipient/tail-only | warm-prefix TTFT p50 s | recipient/warm-prefix |" in printed
    doc = json.loads((out / "results.json").read_text())
    passes = {(p["label"], p["preset"]): p for p in doc["passes"]}
    assert set(passes) == {(m, w) for m in ("off", "on") for w in ("staggered", "burst")}
    assert [len(passes[m, w]["records"]) for m in ("off", "on") for w in ("staggered", "burst")] == [7, 3, 7, 3]
    assert passes["on", "staggered"]["summary"]["recipient_over_tail"] > 0
    assert passes["on", "staggered"]["summary"]["recipient_over_warm"] > 0
    off, on = passes["off", "staggered"]["summary"], passes["on", "staggered"]["summary"]
    # Recipients reuse the running donor's prefix only with reuse on, and the server's counters agree.
    assert on["prefill_tokens"] < off["prefill_tokens"]
    assert on["server_donor_tokens"] > 0 and off["server_donor_tokens"] == 0
    assert on["server_prefilled_tokens"] == on["prefill_tokens"]
    assert (out / "summary.md").read_text().strip() in printed
    assert (out / "ttft.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "on.log").exists()


def test_paired_counts_differing_outputs_and_fails(tiny_model_dir, tmp_path, capsys):
    code = main(["paired", "--model", tiny_model_dir("llama"), "--preset", "staggered", "--n", "3",
                 "--prefix-tokens", "150", "--max-tokens", "8", "--threshold", "32",
                 "--server-arg=--perturb-reuse", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1
    assert "staggered, on vs off: greedy outputs: 2 of 7 differ (staggered-1, staggered-2)" in captured.out
    assert "2 greedy output(s) differ" in captured.err


def test_daemon_that_does_not_start_fails_clearly(tiny_model_dir, tmp_path, capsys):
    code = main(["paired", "--model", tiny_model_dir("llama"), "--preset", "burst", "--modes", "off",
                 "--server-arg=--no-such-flag", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    assert "off: skipped: kvfork (off) exited with code 2" in err and "--no-such-flag" in err


def test_cli_rejects_bad_input(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text("{oops\n")
    assert main(["run", "--url", "http://127.0.0.1:9", "--trace", str(bad)]) == 2
    assert "t.jsonl:1: not JSON" in capsys.readouterr().err
    assert main(["paired", "--model", "m", "--modes", "off,sideways"]) == 2
    assert "unknown mode 'sideways'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--url", "u", "--max-tokens", "9-3"])


def test_smoke_passes_on_exact_reuse(tiny_model_dir, tmp_path, capsys):
    code = smoke.main(["--model", tiny_model_dir("llama"), "--prompt-tokens", "400", "--max-tokens", "64",
                       "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "smoke: PASS" in printed
    assert "recipient vs fresh prefill: same" in printed and "donor vs fresh: same" in printed


def test_smoke_fails_when_reuse_changes_the_answer(tiny_model_dir, tmp_path, capsys):
    code = smoke.main(["--model", tiny_model_dir("llama"), "--prompt-tokens", "400", "--max-tokens", "64",
                       "--server-arg=--perturb-reuse", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 1
    assert "recipient vs fresh prefill: DIFFERENT" in printed and "smoke: FAIL" in printed


def test_smoke_fails_without_reuse(tiny_model_dir, tmp_path, capsys):
    # A threshold no prompt reaches: the recipient prefills everything itself.
    code = smoke.main(["--model", tiny_model_dir("llama"), "--prompt-tokens", "400", "--max-tokens", "64",
                       "--threshold", "100000", "--out", str(tmp_path)])
    assert code == 1
    assert "smoke: FAIL" in capsys.readouterr().out


def test_peer_that_cannot_be_built_is_skipped(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path))
    monkeypatch.setattr(peers.shutil, "which", lambda tool: None)
    assert peers.contender("llama", "m", None, tmp_path) is None
    assert "skipping llama: building llama-server needs cmake and c++" in capsys.readouterr().err
    assert peers.contender("vllm", "m", None, tmp_path) is None
    assert "unknown peer 'vllm'" in capsys.readouterr().err


def fake_binary(path: Path, exit_code: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    path.chmod(0o755)
    return path


def cache_llama_server(home: Path, exit_code: int = 0, flags: tuple[str, ...] = peers.LLAMA_CMAKE_FLAGS) -> Path:
    binary = fake_binary(home / "peers" / "llama.cpp" / "llama-server", exit_code)
    peers.build_stamp(binary).write_text("\n".join(flags) + "\n")
    return binary


def test_cached_llama_server_is_reused_without_building(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path))
    monkeypatch.setattr(peers.shutil, "which", lambda tool: None)  # a build would fail
    binary = cache_llama_server(tmp_path)
    gguf = tmp_path / "m.gguf"
    c = peers.contender("llama", "m", str(gguf), tmp_path)
    assert c is not None and not c.kvfork
    srv = c.make(tmp_path / "llama.log")
    assert srv.argv[:3] == [str(binary), "-m", str(gguf)]


@pytest.mark.parametrize("case", ["no stamp", "other flags", "fails --version"])
def test_a_stale_or_broken_cached_llama_server_is_built_again(monkeypatch, tmp_path, capsys, case):
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path))
    monkeypatch.setattr(peers.shutil, "which", lambda tool: None)  # the rebuild stops at its first step
    binary = cache_llama_server(tmp_path, exit_code=127 if case == "fails --version" else 0,
                                flags=peers.LLAMA_CMAKE_FLAGS[:-1] if case == "other flags" else peers.LLAMA_CMAKE_FLAGS)
    if case == "no stamp":
        peers.build_stamp(binary).unlink()
    assert peers.contender("llama", "m", str(tmp_path / "m.gguf"), tmp_path) is None
    err = capsys.readouterr().err
    assert "building it again" in err and "skipping llama: building llama-server needs cmake" in err


def test_cmake_builds_only_the_server_statically():
    cmd = peers.cmake_command(Path("src"), Path("build"))
    assert "-DLLAMA_BUILD_SERVER=ON" in cmd and "-DLLAMA_BUILD_TESTS=OFF" in cmd
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in cmd  # no download during the build
    assert "-DBUILD_SHARED_LIBS=OFF" in cmd  # only the binary is kept: it must not need the build's libraries


def test_the_cached_llama_server_starts():
    """The real cached binary, if `make peers` built one here with the flags this checkout asks for (this never builds)."""
    binary = peers.peers_home() / "llama.cpp" / "llama-server"
    if not binary.exists():
        pytest.skip("no cached llama-server (make peers builds it)")
    stamp = peers.build_stamp(binary)
    if not stamp.exists() or stamp.read_text().split() != list(peers.LLAMA_CMAKE_FLAGS):
        pytest.skip(f"{binary} was built with other flags: make peers builds it again")
    done = subprocess.run([str(binary), "--version"], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]


def test_run_replays_a_trace_against_a_running_server(tiny_model_dir, tmp_path, capsys):
    trace = tmp_path / "agent.jsonl"
    rows = [{"t": 0, "session": "a", "prompt_tokens": 120, "prefix": "sys", "prefix_tokens": 100, "max_tokens": 4},
            {"t": 0, "session": "b", "prompt_tokens": 130, "prefix": "sys", "prefix_tokens": 100, "max_tokens": 4},
            {"t": 0.2, "session": "a", "messages": [{"role": "user", "content": "next"}], "max_tokens": 4}]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    argv = [*DOUBLE, "--model", tiny_model_dir("llama"), "--port", "{port}"]
    with ServerProcess("double", argv, tmp_path / "double.log") as srv:
        code = main(["run", "--url", srv.base_url, "--trace", str(trace), "--out", str(tmp_path / "out")])
    assert code == 0
    assert "**agent**" in capsys.readouterr().out
    records = json.loads((tmp_path / "out" / "results.json").read_text())["passes"][0]["records"]
    assert [r["call_id"] for r in records] == ["trace-1", "trace-2", "trace-3"]
    assert all(r["error"] is None and r["output_tokens"] == 4 for r in records)
    assert records[2]["send_s"] >= records[0]["send_s"] + records[0]["e2e_s"]  # session order kept


def test_installed_mlx_peer_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path))
    venv = tmp_path / "peers" / "mlx-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").touch()
    c = peers.contender("mlx", "/models/m", None, tmp_path)
    srv = c.make(tmp_path / "mlx.log")
    assert srv.argv[:5] == [str(venv / "bin" / "python"), "-m", "mlx_lm.server", "--model", "/models/m"]
    # A fair peer: the same optimized BLAS kvfork preloads for its own MLX path.
    assert srv.env.get("LD_PRELOAD") == find_openblas()


def test_llama_server_build_steps_and_cache(monkeypatch, tmp_path):
    """The build orchestration with each command faked: sdist in, cached binary out, never built twice."""
    import io
    import tarfile

    ran = []

    def fake_check(cmd, what, log, cwd=None):
        ran.append(cmd)
        if cmd[1:4] == ["-m", "pip", "download"]:
            dest = Path(cmd[cmd.index("-d") + 1])
            with tarfile.open(dest / "llama_cpp_python-9.9.tar.gz", "w:gz") as tar:
                info = tarfile.TarInfo("llama_cpp_python-9.9/vendor/llama.cpp/CMakeLists.txt")
                info.size = 3
                tar.addfile(info, io.BytesIO(b"x()"))
        elif "--build" in cmd:
            fake_binary(Path(cmd[cmd.index("--build") + 1]) / "bin" / "llama-server")

    monkeypatch.setattr(peers, "_check", fake_check)
    monkeypatch.setattr(peers.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    binary = peers.llama_server(tmp_path)
    assert peers.runs(binary)
    assert peers.build_stamp(binary).read_text().split() == list(peers.LLAMA_CMAKE_FLAGS)
    assert [c[0] for c in ran][1:] == ["cmake", "cmake"]
    assert ran[1][ran[1].index("-S") + 1].endswith("llama_cpp_python-9.9/vendor/llama.cpp")
    assert peers.llama_server(tmp_path) == binary and len(ran) == 3  # cached: nothing runs again
    assert not list(tmp_path.glob(".llama-build-*"))  # the work folder is gone


def test_each_kvfork_server_gets_an_empty_home_of_its_own(tmp_path):
    """The disk tier must not carry one server's spilled prefixes into another's passes."""
    servers = [paired.kvfork_contender(mode, "model", None, []).make(tmp_path / f"{mode}.log") for mode in ("off", "on")]
    homes = [Path(s.env["KVFORK_HOME"]) for s in servers]
    assert homes[0] != homes[1]
    assert all(home.is_dir() and not any(home.iterdir()) for home in homes)
    for server, home in zip(servers, homes):
        server.stop()
        assert not home.exists()
