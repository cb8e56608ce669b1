"""The launcher as a user runs it: bad flags exit 2 with one line; serve prints what it did and stops on SIGINT."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import urllib.request
from typing import Iterator

import pytest

from kvfork.backends.mlx.blas import find_openblas
from tiny_models import write_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kvfork(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfork.server.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.mark.parametrize("args, flag", [
    (["--port", "70000"], "--port"),
    (["--inference-slots", "0"], "--inference-slots"),
    (["--backend", "tpu"], "--backend"),
    (["--max-body-bytes", "10"], "--max-body-bytes"),
    (["--temperature-typo", "1"], "--temperature-typo"),
    (["--model", "/no/such/folder"], "--model"),
    (["--api-key", ""], "--api-key"),
    (["--api-keys-file", "/no/such/keys"], "--api-keys-file"),
    (["--prefix-cache-warm", "/no/such/prompts.json"], "--prefix-cache-warm"),
    (["--prefix-cache-disk-bytes", "-1"], "--prefix-cache-disk-bytes"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
    (["--kv-group-size", "48"], "--kv-group-size"),
    (["--model", "no-such-org/no-such-model"], "--model"),  # a hub id the (offline) hub cannot give
])
def test_invalid_values_exit_2_with_one_line(args, flag):
    done = kvfork("serve", *args, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and lines[0].startswith("kvfork serve: error:")


def test_commands():
    assert kvfork("frobnicate").returncode == 2
    listing = kvfork("--help")
    assert listing.returncode == 0 and all(c in listing.stdout for c in ("serve", "fetch-model", "bench", "smoke"))
    fetch = kvfork("fetch-model", "--help")  # dispatched to backends.default_model, imported only now
    assert fetch.returncode == 0 and "kvfork fetch-model" in fetch.stdout
    serve_help = kvfork("serve", "--help")
    for flag in ("--model", "--backend", "--dtype", "--host", "--port", "--api-key", "--served-model-name",
                 "--accept-any-model", "--max-body-bytes", "--log-level", "--max-context", "--inference-slots",
                 "--active-prefix-reuse-min-tokens"):
        assert flag in serve_help.stdout


def preloads_openblas(pid: int) -> bool:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return b"libopenblas" in env.get(b"LD_PRELOAD", b"")


@pytest.mark.skipif(not (sys.platform.startswith("linux") and find_openblas()), reason="needs Linux with OpenBLAS")
@pytest.mark.parametrize("backend, preloaded", [("mlx", True), ("torch", False)])
def test_serve_preloads_openblas_for_mlx_only(tiny_model_dir, backend, preloaded):
    # Inherited either way: the daemon adds it for MLX and drops it for torch, whose BLAS it slows.
    env = dict(os.environ, LD_PRELOAD="" if preloaded else find_openblas())
    env.pop("KVFORK_BLAS_CHECKED", None)
    with subprocess.Popen(
        [sys.executable, "-m", "kvfork.server", "--model", tiny_model_dir("llama"), "--backend", backend, "--port", "0",
         "--kv-budget-bytes", str(64 * 1024 * 1024)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    ) as process:
        try:
            for line in process.stdout:  # type: ignore[union-attr]
                if "listening on" in line or process.poll() is not None:
                    break
            assert "listening on" in line
            assert preloads_openblas(process.pid) == preloaded
        finally:
            process.kill()
            process.wait(timeout=30)


@contextlib.contextmanager
def started(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m kvfork.server ARGS`, read up to its "set aside" line (or its exit): the process and its output so far.
    Killed after the block if still running."""
    with subprocess.Popen([sys.executable, "-m", "kvfork.server", *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env) as process:
        try:
            lines = []
            for line in process.stdout:  # type: ignore[union-attr]
                lines.append(line)
                if "set aside" in line:
                    break
            yield process, "".join(lines)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def test_serve_prints_what_it_loaded_and_where_and_stops_on_sigint(tiny_model_dir):
    with started("--model", tiny_model_dir("llama"), "--backend", "mlx", "--port", "0", "--kv-budget-bytes", "64MiB",
                 "--served-model-name", "tiny") as (process, text):
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text).group(1)  # type: ignore[union-attr]
        assert "loaded" in text and "as tiny" in text and "0.06 GiB for KV state" in text
        with urllib.request.urlopen(url + "/health") as r:
            assert r.status == 200
        process.send_signal(signal.SIGINT)
        rest = process.communicate(timeout=60)[0]
        assert process.returncode == 0 and "shutting down" in rest


@pytest.mark.parametrize("backend, head_dim, flags, says", [
    ("torch", 16, ["int8"], "--kv-cache-dtype int8: head size 16 is not a multiple of --kv-group-size 64"),
    ("torch", 96, ["int4", "--kv-group-size", "32"],
     "--kv-cache-dtype int4: head size 96 is not a power of two, which its keys' Hadamard rotation needs"),
    ("mlx", 16, ["fp8"], "--kv-cache-dtype fp8: MLX has no such storage; choose int8 (as small, with a scale and bias "
                         "per group)"),
    ("mlx", 64, ["float16", "--batch-invariant"],
     "--batch-invariant: on MLX, attention reads int8 or int4 rows in place in its one order (kv_reading.c, which "
     "needs a C compiler): --kv-cache-dtype int8 or int4, or --backend torch for any storage"),
])
def test_a_kv_cache_dtype_the_model_or_backend_cannot_take_exits_2_with_one_line(tiny_model_dir, tmp_path, backend,
                                                                                 head_dim, flags, says):
    model = tiny_model_dir("llama") if head_dim == 16 else str(write_model(tmp_path, "llama", head_dim=head_dim))
    with started("--model", model, "--backend", backend, "--port", "0", "--kv-cache-dtype", *flags) as (process, text):
        assert process.wait(timeout=60) == 2
    refusal = [line for line in text.splitlines() if line.startswith("kvfork serve: error:")]
    assert refusal == [f"kvfork serve: error: {says}"]


def test_a_start_prints_the_budget_it_chose_and_why_and_refuses_one_too_small(tiny_model_dir):
    model = tiny_model_dir("llama")
    with started("--model", model, "--backend", "mlx", "--port", "0") as (_, text):
        # the device's rule: physical memory on a CPU, Metal's working set on Apple Silicon; a tiny model's weights
        # (and in the 16-bit storages; its heads of 16 cannot be grouped)
        budget = re.search(r"kvfork: KV budget (\S+) GiB = \S+ tokens in float32 \(float16: \S+, bfloat16: \S+\): "
                           r"(0\.75 of \S+ GiB physical memory|\S+'s recommended working set) .* - 0\.00 GiB weights - "
                           r"\S+ GiB headroom", text)
        assert budget is not None, text
        assert f"set aside {budget.group(1)} GiB for KV state" in text
    with started("--model", model, "--backend", "mlx", "--port", "0", "--kv-budget-bytes", "4KiB") as (process, text):
        assert process.wait(timeout=60) == 2
    refusal = [line for line in text.splitlines() if line.startswith("kvfork serve: error:")]
    assert len(refusal) == 1 and "cannot hold one request at the full context" in refusal[0]
    assert refusal[0].endswith("raise --kv-budget-bytes or lower --max-context")
