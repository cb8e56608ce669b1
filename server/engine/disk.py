"""The prefix cache's disk tier: snapshots evicted from memory, kept in files that outlive the process.

Layout: `$KVFORK_HOME/kv/<fingerprint>/<key>.safetensors`, one file per entry, where
the fingerprint names the model, dtype, backend and KV format (`fingerprint`), and
the key hashes the entry's scope and tokens. A file holds one SavedState
(backends/base.py's saved-state rule) as safetensors, never pickle:
  `layers.<i>.<kind>.<array>.<first>-<end>`  one tensor per layer array; attention
      arrays cover the token range [first, end), recurrent ones the state at `end`;
  metadata: format version, fingerprint, position, the tokens, the scope's digest,
      each layer's kind, and a CRC-32 over all of that and every tensor's bytes.
Keying each tensor by its token range means spilling shared blocks later (one file
per block, an entry naming its blocks) changes the indexing, not the format.

Design rules:
- the control loop owns the index; file work runs on one worker thread, and its
  results come back to the loop (`loop.call_soon_threadsafe`): a slow disk never
  blocks the loop or the runner;
- writes are crash-safe: a temporary file, fsync, rename, fsync of the folder;
  a torn or corrupt file fails its checksum (or its parse), is removed, counted,
  and never used: its request prefills instead;
- one lock (fcntl.flock) per fingerprint folder: a daemon that cannot take it runs
  without the tier, so two daemons never delete each other's files; at start the
  index is rebuilt from the headers, and folders of other fingerprints that no
  daemon holds are emptied. Nothing outside `$KVFORK_HOME/kv` is ever deleted;
- the tier is capped in bytes, least recently used first out; where any prefix of
  a state can be cloned (full-attention layers only), a file of a longer prompt
  replaces the files of the prompts it begins with (an agent's growing history
  keeps one file per conversation, not one per call);
- a write that fails for want of room or permission (a full disk, a read-only
  folder) turns the tier off with one warning; serving goes on without it.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import json
import logging
import os
import struct
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from backends.base import SavedLayer, SavedState
from server.engine.api import Scope
from server.engine.matching import Source, ranked_matches, window_floor

log = logging.getLogger("kvfork.disk")

KV_FORMAT_VERSION = "1"  # bump when the file layout or the saved-state rule changes: old files are then dropped
SUFFIX = ".safetensors"
LOCK = "lock"
# The tokenizer's files, and the converter's record (tools/gguf_convert.py: its version)
_MODEL_FILES = ("kvfork-converted.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
_GIVE_UP = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)  # the tier goes off


def kv_root() -> Path:
    """`$KVFORK_HOME/kv` (KVFORK_HOME as tools/fetch_model.py resolves it)."""
    from tools.fetch_model import kvfork_home

    return kvfork_home() / "kv"


def fingerprint(model_dir: str | Path, dtype: str, backend: str) -> str:
    """What a file's KV state depends on: the model's config, tokenizer, converter version and weights
    (their safetensors headers and sizes, not their gigabytes), dtype, backend, and the KV format."""
    folder = Path(model_dir)
    h = hashlib.sha256()

    def feed(label: str, data: bytes) -> None:
        h.update(f"{label}:{len(data)}:".encode())
        h.update(data)

    feed("config.json", (folder / "config.json").read_bytes())
    for name in _MODEL_FILES:
        if (folder / name).is_file():
            feed(name, (folder / name).read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            feed(path.name, f.read(min(n, 100_000_000)) + str(path.stat().st_size).encode())
    for label, value in (("dtype", dtype), ("backend", backend), ("format", KV_FORMAT_VERSION)):
        feed(label, value.encode())
    return h.hexdigest()[:20]


def scope_digest(scope: Scope) -> str:
    """A scope as files name it: never the tenant's name (it may be an API key)."""
    return hashlib.sha256(json.dumps([scope.tenant, scope.salt]).encode()).hexdigest()[:32]


def entry_name(scope: Scope, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(scope_digest(scope).encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()[:40]


class CorruptFile(Exception):
    """A file that fails its parse or its checksum: removed, counted, never used."""


# ---- the file format ----


def _checksum(meta: dict[str, str], tensors: dict[str, np.ndarray]) -> str:
    crc = zlib.crc32(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        a = tensors[name]
        crc = zlib.crc32(f"{name}:{a.dtype.str}:{a.shape}".encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(a).data, crc)
    return f"{crc:08x}"


def encode(state: SavedState, tokens: Sequence[int], scope: Scope, fp: str) -> bytes:
    tensors: dict[str, np.ndarray] = {}
    for i, layer in enumerate(state.layers):
        for j, a in enumerate(layer.arrays):
            tensors[f"layers.{i}.{layer.kind}.{j}.{layer.first}-{state.position}"] = np.ascontiguousarray(a)
    meta = {"kvfork_kv": KV_FORMAT_VERSION, "fingerprint": fp, "position": str(state.position),
            "tokens": json.dumps(list(tokens)), "scope": scope_digest(scope),
            "layers": json.dumps([[layer.kind, layer.first, len(layer.arrays)] for layer in state.layers])}
    meta["checksum"] = _checksum(meta, tensors)
    return save_tensors(tensors, metadata=meta)


def decode(data: bytes, fp: str) -> tuple[SavedState, list[int], str]:
    """(state, tokens, scope digest) of a file's bytes; CorruptFile when anything is off."""
    try:
        n = struct.unpack("<Q", data[:8])[0]
        meta = json.loads(data[8 : 8 + n])["__metadata__"]
        tensors = load_tensors(data)
    except Exception as exc:
        raise CorruptFile(f"unreadable: {exc!r}") from None
    stated = meta.pop("checksum", None)
    if stated != _checksum(meta, tensors):
        raise CorruptFile("checksum mismatch")
    if meta.get("kvfork_kv") != KV_FORMAT_VERSION or meta.get("fingerprint") != fp:
        raise CorruptFile("written for another model or format")
    try:
        position, layers = int(meta["position"]), []
        for i, (kind, first, count) in enumerate(json.loads(meta["layers"])):
            # safetensors hands out writable arrays of their own: a backend may take them as they are
            arrays = tuple(tensors[f"layers.{i}.{kind}.{j}.{first}-{position}"] for j in range(count))
            layers.append(SavedLayer(kind, arrays, first))
        return SavedState(position, tuple(layers)), json.loads(meta["tokens"]), meta["scope"]
    except Exception as exc:
        raise CorruptFile(f"inconsistent: {exc!r}") from None


def read_header(path: Path) -> dict[str, str]:
    """A file's metadata, without reading its tensors."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 64 * 1024 * 1024:
            raise CorruptFile("header too large")
        return json.loads(f.read(n))["__metadata__"]


def _write_file(folder: Path, name: str, data: bytes) -> None:
    """Temporary file, fsync, rename, fsync of the folder: a crash leaves the old state or the new."""
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / f"{name}{SUFFIX}")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the tier ----


@dataclass
class DiskEntry:
    tokens: tuple[int, ...]
    scope: str  # scope_digest
    name: str
    file_bytes: int


@dataclass(frozen=True)
class DiskMatch:
    entry: DiskEntry
    upto: int


@dataclass
class DiskStats:
    """What /metrics reads (aggregate only: no scope, no tokens)."""

    spilled: int = 0
    restored: int = 0
    corrupt: int = 0  # files refused and removed
    evicted: int = 0
    failed: int = 0  # writes or reads that failed for another reason


def _try_lock(folder: Path) -> int | None:
    """An exclusive flock on `folder`'s lock file, or None when another daemon holds it."""
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _empty_folder(folder: Path) -> None:
    """Remove what the tier writes there (entries, temporaries, the lock), then the folder if empty."""
    for path in folder.iterdir():
        if path.name.endswith((SUFFIX, ".tmp")) or path.name == LOCK:
            path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # something else lives there: left alone


class DiskTier:
    """One fingerprint folder, its index (control loop only) and its worker thread."""

    def __init__(self, folder: Path, fp: str, max_bytes: int, windows: Iterable[int] = (), recurrent: bool = False):
        self.folder, self.fp, self.max_bytes = folder, fp, max_bytes
        self.windows, self.recurrent = tuple(windows), recurrent
        self.index: OrderedDict[tuple[str, tuple[int, ...]], DiskEntry] = OrderedDict()  # oldest first
        self.nbytes = 0  # files indexed
        self.pending_bytes = 0  # files being written: counted against the cap before they exist
        self.stats = DiskStats()
        self.on = False
        self._lock_fd: int | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvfork-disk")
        self.watch: Any = None  # told of each file indexed and dropped (server/kv_events.Watch)

    @classmethod
    def open(cls, root: Path, fp: str, max_bytes: int, windows: Iterable[int] = (), recurrent: bool = False
             ) -> DiskTier:
        """The tier of `fp` under `root`, its index rebuilt from disk; off (with one warning) when the
        folder cannot be made or locked."""
        tier = cls(root / fp, fp, max_bytes, windows, recurrent)
        try:
            tier.folder.mkdir(parents=True, exist_ok=True)
            tier._lock_fd = _try_lock(tier.folder)
            if tier._lock_fd is None:
                log.warning("prefix cache disk tier off: another daemon uses %s", tier.folder)
                return tier
            tier.on = True
            tier._rebuild()
            tier._drop_other_fingerprints(root)
        except OSError as exc:
            tier._turn_off(exc)
        return tier

    def _rebuild(self) -> None:
        found = []
        for path in self.folder.iterdir():
            if path.name.endswith(".tmp"):  # a write a crash interrupted
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                try:
                    meta = read_header(path)
                    if meta.get("kvfork_kv") != KV_FORMAT_VERSION or meta.get("fingerprint") != self.fp:
                        raise CorruptFile("another model or format")
                    tokens = tuple(json.loads(meta["tokens"]))
                    entry = DiskEntry(tokens, meta["scope"], path.name.removesuffix(SUFFIX), path.stat().st_size)
                    found.append((path.stat().st_mtime, entry))
                except (CorruptFile, OSError, ValueError, KeyError, struct.error) as exc:
                    log.warning("removed unreadable prefix cache file %s: %r", path.name, exc)
                    self.stats.corrupt += 1
                    path.unlink(missing_ok=True)
        for _, entry in sorted(found, key=lambda item: item[0]):  # least recently written first
            self.index[entry.scope, entry.tokens] = entry
            self.nbytes += entry.file_bytes
        self._trim(0)

    def _drop_other_fingerprints(self, root: Path) -> None:
        for folder in root.iterdir():
            if folder == self.folder or not folder.is_dir() or not (folder / LOCK).exists():
                continue
            fd = _try_lock(folder)
            if fd is None:
                continue  # a running daemon's: never touched
            try:
                log.info("removing prefix cache files of another model or format: %s", folder.name)
                _empty_folder(folder)
            finally:
                os.close(fd)

    def _turn_off(self, exc: BaseException) -> None:
        if self.on or self._lock_fd is None:
            log.warning("prefix cache disk tier off: %s (%r); serving goes on without it", self.folder, exc)
        self.on = False

    def close(self) -> None:
        """Wait for the writes under way, then let the folder go."""
        self._pool.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- the index (control loop) ----

    def worth(self, tokens: Sequence[int], scope: Scope) -> bool:
        """Whether an entry is worth writing: not when a file serves it already (refreshed instead):
        its own, or, on a model of full-attention layers only, one of a longer prompt it begins."""
        digest, tokens = scope_digest(scope), tuple(tokens)
        covering = [key for key in self.index if key[0] == digest and self._serves(key[1], tokens)]
        for key in covering:
            self.index.move_to_end(key)
        return not covering

    def _serves(self, held: tuple[int, ...], tokens: tuple[int, ...]) -> bool:
        """Whether a file of `held` serves every match a file of `tokens` would: the same prompt, or
        a longer one beginning with it where any prefix of a state can be cloned (no sliding window
        to have moved on, no recurrent state held at its end only: base.py's rules)."""
        if held == tokens:
            return True
        return (not self.windows and not self.recurrent and len(held) > len(tokens)
                and held[: len(tokens)] == tokens)

    def lookup(self, prompt: Sequence[int], scope: Scope) -> list[DiskMatch]:
        """Usable matches among `scope`'s files, best first (the prefix cache's rules: matching.py)."""
        if not self.on:
            return []
        digest = scope_digest(scope)
        sources = (Source.entry(key, key[1], stamp, clone_floor=window_floor(len(key[1]), self.windows),
                                positions=(len(key[1]),) if self.recurrent else None)
                   for stamp, (key, entry) in enumerate(self.index.items()) if key[0] == digest)
        return [DiskMatch(self.index[m.key], m.upto) for m in ranked_matches(prompt, sources)]

    def touch(self, entry: DiskEntry) -> None:
        key = entry.scope, entry.tokens
        if key in self.index:
            self.index.move_to_end(key)

    def forget(self, entry: DiskEntry) -> None:
        """Out of the index, and its file removed (a corrupt or missing one)."""
        if self.index.pop((entry.scope, entry.tokens), None) is not None:
            self.nbytes -= entry.file_bytes
            if self.watch is not None:
                self.watch.removed(entry.tokens, entry.scope)
        self._pool.submit(self._remove, entry.name)

    def _trim(self, room: int) -> None:
        """Evict least recently used files until `room` more bytes fit under the cap."""
        while self.index and self.nbytes + self.pending_bytes + room > self.max_bytes:
            _, entry = self.index.popitem(last=False)
            self.nbytes -= entry.file_bytes
            self.stats.evicted += 1
            if self.watch is not None:
                self.watch.removed(entry.tokens, entry.scope)
            self._pool.submit(self._remove, entry.name)

    # ---- file work (worker thread), answered on the loop ----

    def write(self, state: SavedState, tokens: Sequence[int], scope: Scope, done: Callable[[bool], None]) -> None:
        """Encode and write `state` on the worker thread; `done(written)` runs on the loop after."""
        loop = asyncio.get_running_loop()
        size = state.nbytes + 64 * 1024  # the file: the arrays and a header (the tokens' list)
        if not self.on or size > self.max_bytes:
            done(False)
            return
        self._trim(size)
        self.pending_bytes += size
        tokens, name = tuple(tokens), entry_name(scope, tokens)

        def work() -> int:
            data = encode(state, tokens, scope, self.fp)
            _write_file(self.folder, name, data)
            return len(data)

        def finish(result: int | BaseException) -> None:
            self.pending_bytes -= size
            if isinstance(result, BaseException):
                self.stats.failed += 1
                if isinstance(result, OSError) and result.errno in _GIVE_UP:
                    self._turn_off(result)
                else:
                    log.warning("writing a prefix cache file failed: %r", result)
            elif self.on:
                key = scope_digest(scope), tokens
                old = self.index.pop(key, None)
                self.nbytes += result - (old.file_bytes if old else 0)
                self.index[key] = DiskEntry(tokens, key[0], name, result)
                if old is None and self.watch is not None:
                    self.watch.stored(tokens, key[0])
                self.stats.spilled += 1
                # files of prompts this one begins with serve nothing it does not: written once
                for other in [k for k in self.index if k[0] == key[0] and k != key and self._serves(tokens, k[1])]:
                    self.forget(self.index[other])
                self._trim(0)
            done(not isinstance(result, BaseException))

        self._submit(loop, work, finish)

    def read(self, entry: DiskEntry, done: Callable[[SavedState | None, str, float], None]) -> None:
        """Read and check `entry`'s file on the worker thread; `done(state or None, outcome, seconds)`
        runs on the loop (outcome: read, corrupt, missing, failed). A bad file is forgotten."""
        loop = asyncio.get_running_loop()

        def work() -> tuple[SavedState, float]:
            t0 = time.perf_counter()  # the read itself, not its wait behind other file work
            data = (self.folder / f"{entry.name}{SUFFIX}").read_bytes()
            state, tokens, scope = decode(data, self.fp)
            if tuple(tokens) != entry.tokens or scope != entry.scope or state.position != len(entry.tokens):
                raise CorruptFile("holds another entry")
            return state, time.perf_counter() - t0

        def finish(result: tuple[SavedState, float] | BaseException) -> None:
            if not isinstance(result, BaseException):
                self.stats.restored += 1
                done(result[0], "read", result[1])
                return
            if isinstance(result, CorruptFile):
                log.warning("removed corrupt prefix cache file %s: %s", entry.name, result)
                self.stats.corrupt += 1
                outcome = "corrupt"
            elif isinstance(result, FileNotFoundError):
                outcome = "missing"
            else:
                log.warning("reading prefix cache file %s failed: %r", entry.name, result)
                self.stats.failed += 1
                outcome = "failed"
            self.forget(entry)
            done(None, outcome, 0.0)

        self._submit(loop, work, finish)

    def _submit(self, loop: asyncio.AbstractEventLoop, work: Callable[[], Any], finish: Callable[[Any], None]) -> None:
        def run() -> None:
            try:
                result = work()
            except BaseException as exc:  # answered on the loop, whatever it was
                result = exc
            try:
                loop.call_soon_threadsafe(finish, result)
            except RuntimeError:  # the loop is closed: nobody waits for it any more
                pass

        try:
            self._pool.submit(run)
        except RuntimeError:  # closed
            finish(RuntimeError("the disk tier is closed"))

    def _remove(self, name: str) -> None:
        try:
            (self.folder / f"{name}{SUFFIX}").unlink(missing_ok=True)
        except OSError as exc:
            log.warning("removing prefix cache file %s failed: %r", name, exc)


# ---- `kvfork cache` ----


def describe(root: Path) -> list[dict[str, Any]]:
    """Each fingerprint folder under `root`: entries, bytes, whether a daemon holds it."""
    out = []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if not folder.is_dir():
            continue
        files = [p for p in folder.iterdir() if p.name.endswith(SUFFIX)]
        held = False
        if (folder / LOCK).exists():
            fd = _try_lock(folder)
            held = fd is None
            if fd is not None:
                os.close(fd)
        out.append({"fingerprint": folder.name, "entries": len(files), "bytes": sum(p.stat().st_size for p in files),
                    "in_use": held})
    return out


def clear(root: Path) -> tuple[int, list[str]]:
    """Empty every fingerprint folder no daemon holds: (files removed, folders skipped as in use)."""
    removed, skipped = 0, []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if not folder.is_dir():
            continue
        fd = _try_lock(folder)
        if fd is None:
            skipped.append(folder.name)
            continue
        try:
            removed += sum(1 for p in folder.iterdir() if p.name.endswith(SUFFIX))
            _empty_folder(folder)
        finally:
            os.close(fd)
    return removed, skipped
