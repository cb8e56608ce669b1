"""Converted folders under $KVFORK_HOME/models, made once and found again.

A GGUF at a path is converted into `models/gguf/<digest>/<file stem>` (so the served model
name is the file's stem), the digest standing for the file's path, size and modification time:
an edited or replaced file converts anew, an unchanged one is found at once. Each folder
carries a stamp of what it was made from and by which converter version; a stale one is
rebuilt. A folder appears atomically (built in a temp folder beside it, then renamed), so an
interrupted or concurrent conversion never leaves half a model behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from kvfork.backends.gguf.convert import CONVERTER_VERSION, convert_gguf
from kvfork.backends.model_path import kvfork_home

STAMP = "kvfork-converted.json"


def stamp_matches(folder: Path, stamp: dict[str, object]) -> bool:
    """True when `folder` was made from what `stamp` records (every key equal)."""
    try:
        found = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return all(found.get(key) == value for key, value in stamp.items())


def install(built: Path, target: Path, stamp: dict[str, object], keep_current: bool = True) -> None:
    """Move a finished folder into place, swapping out the one there.

    A current folder already there came from a concurrent run that finished
    first: unless forced, it is kept (a reader may have it open) and `built` stays put.
    """
    if keep_current and stamp_matches(target, stamp):
        return
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
    try:
        built.rename(target)
    except OSError:
        if not stamp_matches(target, stamp):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build(target: Path, stamp: dict[str, object], make: Callable[[Path, Path], None], force: bool = False) -> None:
    """`make(work, built)` fills `built` (with `work` for anything else); stamped, it is installed at target."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp-") as work:
        built = Path(work) / "model"
        built.mkdir()
        start = time.perf_counter()
        make(Path(work), built)
        stamp = dict(stamp, converted_in_s=round(time.perf_counter() - start, 2))
        (built / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        install(built, target, {k: v for k, v in stamp.items() if k != "converted_in_s"}, keep_current=not force)


def gguf_stamp(path: Path) -> dict[str, object]:
    stat = path.stat()
    return {"converter_version": CONVERTER_VERSION, "source": str(path), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns}


def converted_folder(gguf_path: Path) -> Path:
    """The Hugging Face folder of a GGUF file, converted first when missing or stale."""
    path = gguf_path.expanduser().resolve()
    stamp = gguf_stamp(path)
    digest = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
    target = kvfork_home() / "models" / "gguf" / digest / path.stem
    if not stamp_matches(target, stamp):
        _log(f"converting {path} into {target} (once: later starts find it there)")
        build(target, stamp, lambda _, built: convert_gguf(path, built, log=_log))
    return target


def _log(message: str) -> None:
    print(f"kvfork: gguf: {message}", file=sys.stderr, flush=True)
