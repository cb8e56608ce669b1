"""The servers people would otherwise pick, set up once and cached.

- mlx_lm.server, in its own virtual environment, on the same model folder;
- llama.cpp's llama-server, built from the source the `llama-cpp-python` sdist
  on PyPI carries (about 20 minutes on 2 cores: built once, then cached), on
  the GGUF the default model is converted from.

Everything lives under $KVFORK_HOME/peers (default ~/.cache/kvfork/peers). A
peer that cannot be set up is skipped with a message saying why.

llama-server is linked statically: the build folder is temporary, and only the
binary is kept. It is built for named instruction sets, not `-march=native`: a
virtual machine may advertise what it does not execute (AMX: `tilezero` traps with
SIGILL at the first matrix product), so AMX stays off and AVX-512 is on where the
CPU reports it. The flags are stamped beside the binary; a binary whose stamp is
missing or different is built again. A binary counts as working once it has loaded
the GGUF and answered one short completion (`--version` runs no kernel): a cached
one that does not is built again, a new one that does not is set aside with the
reason, and the peer is skipped saying why until the flags change.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from kvfork.backends.device_memory import cpu_flags
from kvfork.backends.mlx.blas import find_openblas, thread_env
from kvfork.tools.bench.paired import Contender
from kvfork.tools.bench.serve import ServerFailed, ServerProcess

PEERS = ("mlx", "llama")


class PeerUnavailable(RuntimeError):
    pass


def peers_home() -> Path:
    home = os.environ.get("KVFORK_HOME") or Path.home() / ".cache" / "kvfork"
    return Path(home).expanduser() / "peers"


def _say(message: str) -> None:
    print(f"peers: {message}", file=sys.stderr, flush=True)


def _check(cmd: list[str], what: str, log: Path, cwd: Path | None = None) -> None:
    _say(f"{what} (log: {log})")
    with open(log, "ab") as out:
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd).returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-8:])
            raise PeerUnavailable(f"{what} failed:\n{tail}")


def mlx_python(home: Path) -> Path:
    """The Python of a virtual environment holding mlx-lm, made on first use."""
    venv = home / "mlx-venv"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    if stamp.exists():
        return python
    home.mkdir(parents=True, exist_ok=True)
    log = home / "mlx-setup.log"
    _check([sys.executable, "-m", "venv", str(venv)], "creating the mlx_lm.server venv", log)
    packages = ["mlx-lm", "mlx[cpu]"] if sys.platform == "linux" else ["mlx-lm"]
    _check([str(python), "-m", "pip", "install", "-q", *packages], "installing mlx-lm into it", log)
    stamp.touch()
    return python


# The server alone, plain HTTP on localhost: no tests, examples or web UI (whose
# prebuilt copy would be fetched from a model hub), no TLS; static, so the binary
# runs without the build folder's shared libraries.
LLAMA_BUILD_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)  # fmt: skip
# x86-64 instruction sets ggml may use: always the AVX2 generation; each AVX-512 extension where
# /proc/cpuinfo lists it; AMX never (advertised by virtual machines that trap on it).
BASE_ISA = ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C")
AVX512 = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}  # what ggml's GGML_AVX512 compiles for
AVX512_EXTENSIONS = {"GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}
NEVER_ISA = ("GGML_AVX_VNNI", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
ANSWER_TIMEOUT_S = 120.0  # to load the GGUF and complete a few tokens: seconds on a 135M model


def llama_cmake_flags(cpu: set[str]) -> tuple[str, ...]:
    """Every cmake flag of the build: the server alone, and on x86-64 the instruction sets named one by one."""
    if not {"avx2", "fma", "f16c"} <= cpu:  # not x86-64 of the AVX2 generation: ggml's own default
        return LLAMA_BUILD_FLAGS
    avx512 = AVX512 <= cpu
    isa = [f"-D{name}=ON" for name in BASE_ISA] + [f"-DGGML_AVX512={'ON' if avx512 else 'OFF'}"]
    isa += [f"-D{name}={'ON' if avx512 and flag in cpu else 'OFF'}" for name, flag in AVX512_EXTENSIONS.items()]
    isa += [f"-D{name}=OFF" for name in NEVER_ISA]
    return (*LLAMA_BUILD_FLAGS, "-DGGML_NATIVE=OFF", *isa)


def cmake_command(src: Path, build: Path, flags: tuple[str, ...]) -> list[str]:
    return ["cmake", "-S", str(src), "-B", str(build), *flags]


def build_stamp(binary: Path) -> Path:
    return binary.with_name(binary.name + ".flags")


def refusal_note(binary: Path) -> Path:
    """Beside a binary built with the flags this checkout asks for that could not answer: the flags, then why."""
    return binary.with_name(binary.name + ".failed")


def answers(binary: Path, gguf: Path, log: Path) -> str | None:
    """None when `binary` loads `gguf` and answers one short completion; else why it does not."""
    argv = [str(binary), "-m", str(gguf), "--port", "{port}", "--host", "127.0.0.1", "-c", "512", "-np", "1"]
    server = ServerProcess("llama-server", argv, log, ready_timeout_s=ANSWER_TIMEOUT_S)
    reply, failure = None, None
    try:
        with server:
            body = json.dumps({"prompt": "The capital of France is", "n_predict": 4}).encode()
            post = urllib.request.Request(server.base_url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(post, timeout=ANSWER_TIMEOUT_S) as response:
                reply = json.loads(response.read())
    except (ServerFailed, OSError, ValueError) as e:
        failure = str(e).splitlines()[0]
    code = server.proc.returncode if server.proc is not None else None
    if code is not None and code < 0 and -code != signal.SIGTERM:
        name = signal.Signals(-code).name
        why = " (an instruction this CPU does not execute)" if name == "SIGILL" else ""
        return f"it was killed by {name}{why} loading {gguf.name} or completing on it (log: {log})"
    if failure is not None:
        return f"it did not answer a completion on {gguf.name}: {failure} (log: {log})"
    if not isinstance(reply, dict) or not (reply.get("content") or reply.get("tokens_predicted")):
        return f"its completion on {gguf.name} came back empty: {reply!r:.200}"
    return None


def cached_llama_server(home: Path, gguf: Path, flags: tuple[str, ...]) -> Path | None:
    """The cached llama-server if it was built with `flags` and answers on `gguf`; None: build it (again)."""
    binary = home / "llama.cpp" / "llama-server"
    note = refusal_note(binary)
    if note.exists():
        noted_flags, _, why = note.read_text().partition("\n")
        if noted_flags.split() == list(flags):
            raise PeerUnavailable(f"the llama-server built here with these flags cannot serve: {why.strip()} "
                                  f"(remove {note} to build it again)")
    if not binary.exists():
        return None
    stamp = build_stamp(binary)
    if not stamp.exists() or stamp.read_text().split() != list(flags):
        _say(f"{binary} was built with other flags: building it again")
        return None
    why = answers(binary, gguf, home / "llama-check.log")
    if why is not None:
        _say(f"{binary} cannot serve: {why}; building it again")
        return None
    return binary


def llama_server(home: Path, gguf: Path) -> Path:
    """llama-server built from the llama-cpp-python sdist's vendored llama.cpp for this CPU's instruction
    sets, checked on `gguf`; cached after the first build."""
    flags = llama_cmake_flags(cpu_flags())
    cached = cached_llama_server(home, gguf, flags)
    if cached is not None:
        return cached
    done = home / "llama.cpp" / "llama-server"
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise PeerUnavailable(f"building llama-server needs {' and '.join(missing)} (apt-get install cmake g++)")
    home.mkdir(parents=True, exist_ok=True)
    log = home / "llama-build.log"
    with tempfile.TemporaryDirectory(dir=home, prefix=".llama-build-") as work:
        work_dir = Path(work)
        _check([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work_dir),
                "llama-cpp-python"], "downloading the llama-cpp-python sdist", log)
        sdists = list(work_dir.glob("llama_cpp_python-*.tar.gz"))
        if len(sdists) != 1:
            raise PeerUnavailable(f"expected one llama-cpp-python sdist, found {[p.name for p in sdists]}")
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(work_dir, filter="data")
        src = next(work_dir.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
        if src is None or not (src / "CMakeLists.txt").exists():
            raise PeerUnavailable(f"{sdists[0].name} carries no vendor/llama.cpp source")
        build = work_dir / "build"
        _check(cmake_command(src, build, flags), "configuring llama.cpp", log)
        _check(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
               "building llama-server (about 20 minutes on 2 cores, once)", log)
        built = build / "bin" / "llama-server"
        if not built.exists():
            raise PeerUnavailable(f"the build left no {built}")
        why = answers(built, gguf, home / "llama-check.log")
        done.parent.mkdir(parents=True, exist_ok=True)
        if why is not None:
            refusal_note(done).write_text(" ".join(flags) + "\n" + why + "\n")
            raise PeerUnavailable(f"the llama-server just built cannot serve: {why}")
        shutil.copy2(built, done)
        build_stamp(done).write_text("\n".join(flags) + "\n")
        refusal_note(done).unlink(missing_ok=True)
    return done


def default_gguf(home: Path) -> Path:
    """The GGUF the default model folder is converted from, kept for llama.cpp."""
    from kvfork.backends import default_model

    out = home / "gguf" / Path(default_model.GGUF_MEMBER).name
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as work:
            try:
                gguf = default_model.extract_gguf(default_model.download_wheel(Path(work)), Path(work))
            except default_model.FetchError as e:
                raise PeerUnavailable(str(e)) from None
            gguf.rename(out)
    return out


def contender(name: str, model: str, gguf: str | None, out_dir: Path) -> Contender | None:
    """A peer ready to start, or None (with a message) when it cannot be had here."""
    home = peers_home()
    try:
        if name == "mlx":
            python = mlx_python(home)
            argv = [str(python), "-m", "mlx_lm.server", "--model", model, "--port", "{port}"]
            # The same optimized BLAS kvfork gives MLX: without it the peer prefills ~20x slower.
            blas = find_openblas()
            env = {"LD_PRELOAD": blas, **thread_env()} if blas else {}
            return Contender("mlx_lm.server", lambda log: ServerProcess("mlx_lm.server", argv, log, env=env),
                             kvfork=False)
        if name == "llama":
            model_file = Path(gguf) if gguf else default_gguf(home)
            binary = llama_server(home, model_file)
            # 4 slots of 8,192 tokens each (llama.cpp splits -c among the slots).
            argv = [str(binary), "-m", str(model_file), "--port", "{port}", "--host", "127.0.0.1",
                    "-c", "32768", "-np", "4", "-t", str(os.cpu_count() or 2)]
            return Contender("llama-server", lambda log: ServerProcess("llama-server", argv, log), kvfork=False)
        raise PeerUnavailable(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    except (PeerUnavailable, OSError) as e:
        _say(f"skipping {name}: {e}")
        return None
