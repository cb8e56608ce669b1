"""The servers people would otherwise pick, set up once and cached.

- mlx_lm.server, in its own virtual environment, on the same model folder;
- llama.cpp's llama-server, built from the source the `llama-cpp-python` sdist
  on PyPI carries (about 20 minutes on 2 cores: built once, then cached), on
  the GGUF the default model is converted from.

Everything lives under $KVFORK_HOME/peers (default ~/.cache/kvfork/peers). A
peer that cannot be set up is skipped with a message saying why.

llama-server is linked statically: the build folder is temporary, and only the
binary is kept. The build flags are stamped beside it; a binary whose stamp is
missing or different, or that fails `--version`, is built again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from backends.mlx.blas import find_openblas, thread_env
from tools.bench.paired import Contender
from tools.bench.serve import ServerProcess

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
LLAMA_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)  # fmt: skip
VERSION_TIMEOUT_S = 30.0


def cmake_command(src: Path, build: Path) -> list[str]:
    return ["cmake", "-S", str(src), "-B", str(build), *LLAMA_CMAKE_FLAGS]


def build_stamp(binary: Path) -> Path:
    return binary.with_name(binary.name + ".flags")


def runs(binary: Path) -> bool:
    """Whether `binary --version` starts and exits 0 (a binary missing its libraries does not)."""
    try:
        done = subprocess.run([str(binary), "--version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=VERSION_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def cached_llama_server(home: Path) -> Path | None:
    """The cached llama-server if it was built with the flags this checkout asks for and runs; None: build it (again)."""
    binary = home / "llama.cpp" / "llama-server"
    stamp = build_stamp(binary)
    if not binary.exists():
        return None
    if not stamp.exists() or stamp.read_text().split() != list(LLAMA_CMAKE_FLAGS):
        _say(f"{binary} was built with other flags: building it again")
        return None
    if not runs(binary):
        _say(f"{binary} fails --version: building it again")
        return None
    return binary


def llama_server(home: Path) -> Path:
    """llama-server built from the llama-cpp-python sdist's vendored llama.cpp; cached after the first build."""
    cached = cached_llama_server(home)
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
        _check(cmake_command(src, build), "configuring llama.cpp", log)
        _check(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
               "building llama-server (about 20 minutes on 2 cores, once)", log)
        built = build / "bin" / "llama-server"
        if not built.exists():
            raise PeerUnavailable(f"the build left no {built}")
        if not runs(built):
            raise PeerUnavailable(f"the built {built.name} fails --version (see {log})")
        done.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, done)
        build_stamp(done).write_text("\n".join(LLAMA_CMAKE_FLAGS) + "\n")
    return done


def default_gguf(home: Path) -> Path:
    """The GGUF the default model folder is converted from, kept for llama.cpp."""
    from backends import default_model

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
            binary = llama_server(home)
            model_file = Path(gguf) if gguf else default_gguf(home)
            # 4 slots of 8,192 tokens each (llama.cpp splits -c among the slots).
            argv = [str(binary), "-m", str(model_file), "--port", "{port}", "--host", "127.0.0.1",
                    "-c", "32768", "-np", "4", "-t", str(os.cpu_count() or 2)]
            return Contender("llama-server", lambda log: ServerProcess("llama-server", argv, log), kvfork=False)
        raise PeerUnavailable(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    except (PeerUnavailable, OSError) as e:
        _say(f"skipping {name}: {e}")
        return None
