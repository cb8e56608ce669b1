"""Whether a model folder can load, judged before anything is unloaded to make room for it: its config and
its weights' headers are read (not the weights), and a folder whose last load failed is refused while its
files are unchanged, so a broken model answers its error at once instead of evicting a healthy model on
every request for it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER = 100 * 1024 * 1024  # a safetensors header's bytes at most (the format's own limit)


def folder_state(path: str) -> tuple | None:
    """The name, size and modification time of each file of a local model folder (None: not a folder, as a
    GGUF file or a hub id): a load that failed on one state fails again on it."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    return tuple(sorted((f.name, s.st_size, s.st_mtime_ns) for f in folder.iterdir() if f.is_file()
                        for s in [f.stat()]))


def check_folder(path: str) -> None:
    """Raise ValueError naming what keeps a local model folder from loading: a config.json that is not a JSON
    object, no *.safetensors, or a weights file whose header is unreadable or names bytes past its end."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder / 'config.json'} cannot be read: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{folder / 'config.json'} is not a JSON object")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {folder}")
    for f in files:
        _check_safetensors(f)


def _check_safetensors(file: Path) -> None:
    size = file.stat().st_size
    try:
        with file.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > min(MAX_HEADER, size - 8):
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(fh.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e})") from e
    if 8 + length + end > size:
        raise ValueError(f"{file} is cut short: its tensors end at byte {8 + length + end}, the file at {size}")
