"""Converted folders under $KVFORK_HOME/models, made once and found again.

A GGUF at a path is converted into `models/gguf/<digest>/<file stem>` (so the served model
name is the file's stem), the digest standing for the file's path, size and modification time:
an edited or replaced file converts anew, an unchanged one is found at once. Those are public,
so the digest is an HMAC of them under the home's secret ($KVFORK_HOME/kv-secret, the disk
tier's: backends/private_files.py), and `models/gguf` and each digest's folder are 0700 folders
of this user: a folder someone else planted is never at the name looked for, nor inside. Each
folder carries a stamp of what it was made from and by which converter version; a stale one is
rebuilt. A folder appears atomically (built in a temp folder beside it, then renamed), so an
interrupted or concurrent conversion never leaves half a model behind.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from kvfork.backends.gguf.convert import CONVERTER_VERSION, convert_gguf
from kvfork.backends.gguf.reader import UnservableGGUF
from kvfork.backends.home import kvfork_home
from kvfork.backends.private_files import SECRET, private_folder, secret

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
    home = kvfork_home()
    try:
        key = secret(home / SECRET)
        digest = hmac.new(key, b"gguf:" + json.dumps(stamp, sort_keys=True).encode(), hashlib.sha256).hexdigest()
        folder = home / "models" / "gguf" / digest[:32]
        private_folder(folder.parent)
        private_folder(folder)
    except OSError as e:
        raise UnservableGGUF(f"no private folder for the conversion under {home} ({e.strerror}: {e.filename})") \
            from None
    target = folder / path.stem
    if not stamp_matches(target, stamp):
        _log(f"converting {path} into {target} (once: later starts find it there)")
        build(target, stamp, lambda _, built: convert_gguf(path, built, log=_log))
    return target


def _log(message: str) -> None:
    print(f"kvfork: gguf: {message}", file=sys.stderr, flush=True)
