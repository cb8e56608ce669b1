"""Paired mode, the CLI, smoke and peers, with the OpenAI test double started as the daemon.

The double (tests/openai_double.py) takes the daemon's flags, so these run the
tools' real process handling, metrics scraping, reports and exit codes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvfork.backends.mlx.blas import find_openblas
from kvfork.tools import smoke
from kvfork.tools.bench import main, paired, peers
from kvfork.tools.bench.serve import ServerProcess

DOUBLE = [sys.executable, str(Path(__file__).parents[1] / "openai_double.py")]


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
    assert peers.contender("llama", "m", str(tmp_path / "m.gguf"), tmp_path) is None
    assert "skipping llama: building llama-server needs cmake and c++" in capsys.readouterr().err
    assert peers.contender("vllm", "m", None, tmp_path) is None
    assert "unknown peer 'vllm'" in capsys.readouterr().err


# A stand-in for llama-server: /health, and /completion answered ("answers"), answered empty ("empty"),
# or met by dying of SIGILL, as a binary built for instructions the CPU does not execute does.
FAKE_LLAMA_SERVER = """#!{python}
import http.server, json, os, signal, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        if {mode!r} == "sigill":
            os.kill(os.getpid(), signal.SIGILL)
        self.reply({{"content": " Paris", "tokens_predicted": 4}} if {mode!r} == "answers" else {{"content": ""}})

http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""


def fake_llama_server(path: Path, mode: str = "answers") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, mode=mode))
    path.chmod(0o755)
    return path


def checkout_flags() -> tuple[str, ...]:
    return peers.llama_cmake_flags(peers.cpu_flags())


def cache_llama_server(home: Path, mode: str = "answers", flags: tuple[str, ...] | None = None) -> Path:
    binary = fake_llama_server(home / "peers" / "llama.cpp" / "llama-server", mode)
    peers.build_stamp(binary).write_text("\n".join(flags or checkout_flags()) + "\n")
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


@pytest.mark.parametrize("case", ["no stamp", "other flags", "killed by SIGILL at its first completion",
                                  "an empty completion"])
def test_a_stale_or_broken_cached_llama_server_is_built_again(monkeypatch, tmp_path, capsys, case):
    """A binary is judged by loading the GGUF and answering a completion: one that passes `--version` and
    dies at its first matrix product (AMX on a VM that does not execute it) is not a working peer."""
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path))
    monkeypatch.setattr(peers.shutil, "which", lambda tool: None)  # the rebuild stops at its first step
    mode = {"killed by SIGILL at its first completion": "sigill", "an empty completion": "empty"}.get(case, "answers")
    binary = cache_llama_server(tmp_path, mode, flags=checkout_flags()[:-1] if case == "other flags" else None)
    if case == "no stamp":
        peers.build_stamp(binary).unlink()
    assert peers.contender("llama", "m", str(tmp_path / "m.gguf"), tmp_path) is None
    err = capsys.readouterr().err
    assert "building it again" in err and "skipping llama: building llama-server needs cmake" in err
    if mode == "sigill":
        assert "killed by SIGILL (an instruction this CPU does not execute)" in err
    if mode == "empty":
        assert "came back empty" in err


def test_llama_server_is_built_for_named_instruction_sets():
    """Never -march=native (a VM may advertise AMX and trap on it): AVX2 always, AVX-512 where the CPU
    reports it, AMX never; the server alone, statically."""
    sapphire = {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi",
                "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}
    flags = peers.llama_cmake_flags(sapphire)
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_NATIVE=ON" not in flags
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"} <= set(flags)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    older = peers.llama_cmake_flags({"avx2", "fma", "f16c", "bmi2", "avx512_vnni"})  # no AVX-512 foundation
    assert "-DGGML_AVX2=ON" in older and "-DGGML_AMX_TILE=OFF" in older
    assert "-DGGML_AVX512=OFF" in older and "-DGGML_AVX512_VNNI=OFF" in older
    assert peers.llama_cmake_flags({"neon", "asimd"}) == peers.LLAMA_BUILD_FLAGS  # not x86: ggml's own choice
    cmd = peers.cmake_command(Path("src"), Path("build"), flags)
    assert "-DLLAMA_BUILD_SERVER=ON" in cmd and "-DLLAMA_BUILD_TESTS=OFF" in cmd
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in cmd  # no download during the build
    assert "-DBUILD_SHARED_LIBS=OFF" in cmd  # only the binary is kept: it must not need the build's libraries


def test_the_cached_llama_server_answers():
    """The real cached binary, if `make peers` built one here with the flags this checkout asks for (this never builds)."""
    home = peers.peers_home()
    binary = home / "llama.cpp" / "llama-server"
    if not binary.exists():
        pytest.skip("no cached llama-server (make peers builds it)")
    stamp = peers.build_stamp(binary)
    if not stamp.exists() or stamp.read_text().split() != list(checkout_flags()):
        pytest.skip(f"{binary} was built with other flags: make peers builds it again")
    gguf = next((home / "gguf").glob("*.gguf"), None)
    if gguf is None:
        pytest.skip("no GGUF of the default model under the peers' home (make peers keeps one)")
    assert peers.answers(binary, gguf, home / "llama-check.log") is None


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


def fake_build(monkeypatch, mode: str = "answers") -> list[list[str]]:
    """Each build command faked (the sdist carries a stub llama.cpp, the build leaves a fake server in
    `mode`); returns the commands run."""
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
            fake_llama_server(Path(cmd[cmd.index("--build") + 1]) / "bin" / "llama-server", mode)

    monkeypatch.setattr(peers, "_check", fake_check)
    monkeypatch.setattr(peers.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    return ran


def test_llama_server_build_steps_and_cache(monkeypatch, tmp_path):
    """The build orchestration with each command faked: sdist in, a checked binary out, never built twice."""
    ran = fake_build(monkeypatch)
    gguf = tmp_path / "m.gguf"
    binary = peers.llama_server(tmp_path, gguf)
    assert peers.answers(binary, gguf, tmp_path / "check.log") is None
    assert peers.build_stamp(binary).read_text().split() == list(checkout_flags())
    assert [c[0] for c in ran][1:] == ["cmake", "cmake"]
    assert ran[1][ran[1].index("-S") + 1].endswith("llama_cpp_python-9.9/vendor/llama.cpp")
    assert ran[1][ran[1].index("-B") + 2:] == list(checkout_flags())
    assert peers.llama_server(tmp_path, gguf) == binary and len(ran) == 3  # cached: nothing runs again
    assert not list(tmp_path.glob(".llama-build-*"))  # the work folder is gone


def test_a_new_build_that_cannot_serve_is_skipped_with_its_reason_until_the_flags_change(monkeypatch, tmp_path):
    """Both flag sets are the test's own: the machine's CPU may report either."""
    monkeypatch.setattr(peers, "cpu_flags", lambda: {"avx2", "fma", "f16c", "bmi2"} | peers.AVX512)
    ran = fake_build(monkeypatch, "sigill")
    gguf = tmp_path / "m.gguf"
    with pytest.raises(peers.PeerUnavailable, match="killed by SIGILL"):
        peers.llama_server(tmp_path, gguf)
    assert not (tmp_path / "llama.cpp" / "llama-server").exists()  # never cached
    built = len(ran)
    with pytest.raises(peers.PeerUnavailable, match="cannot serve: it was killed by SIGILL.*remove .* to build"):
        peers.llama_server(tmp_path, gguf)
    assert len(ran) == built  # not built again with the same flags
    monkeypatch.setattr(peers, "cpu_flags", lambda: {"avx2", "fma", "f16c", "bmi2"})  # no AVX-512: built again
    fake_build(monkeypatch)
    assert peers.answers(peers.llama_server(tmp_path, gguf), gguf, tmp_path / "check.log") is None
    assert not peers.refusal_note(tmp_path / "llama.cpp" / "llama-server").exists()


def test_each_kvfork_server_gets_an_empty_home_of_its_own(tmp_path):
    """The disk tier must not carry one server's spilled prefixes into another's passes."""
    servers = [paired.kvfork_contender(mode, "model", None, []).make(tmp_path / f"{mode}.log") for mode in ("off", "on")]
    homes = [Path(s.env["KVFORK_HOME"]) for s in servers]
    assert homes[0] != homes[1]
    assert all(home.is_dir() and not any(home.iterdir()) for home in homes)
    for server, home in zip(servers, homes):
        server.stop()
        assert not home.exists()
