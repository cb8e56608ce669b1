"""The prefix cache's disk tier: snapshots evicted from memory, kept in files that outlive the process.

Layout: `$KVFORK_HOME/kv/<fingerprint>/<key>.safetensors`, one file per entry, where
the fingerprint names the model, dtype, backend and KV format (`fingerprint`), and
the key hashes the entry's scope and tokens. A file holds one SavedState
(the saved-state rule: backends.base.SavedState) as safetensors, never pickle:
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
  folder) turns the tier off with one warning; serving goes on without it;
- nothing read is trusted: any failure while reading one file (its header at
  start, its tensors at a hit) removes that file and is counted; it never stops
  the tier, let alone the daemon;
- a file holds a tenant's prompt: files are 0600 and folders 0700 (the lock
  file and the secret too), and a file names its scope only by an HMAC under a
  secret made at first start ($KVFORK_HOME/kv-secret, written whole or not at
  all; one that is not 32 bytes is replaced, with a warning), never by a hash of
  the tenant's name or key that could be guessed offline;
- no link is followed under `$KVFORK_HOME/kv`, nor to the secret: every file is
  opened with O_NOFOLLOW, every folder checked (lstat) to be a folder this user
  owns; another user's or a link is skipped (a link in a fingerprint folder is
  removed, the link alone), so neither the daemon nor `kvfork cache clear`
  reads, chmods or deletes anything it points to;
- at shutdown every write under way is answered on the loop before the worker
  thread stops (`close`), so the last spills land and replace what they should.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from kvfork.backends.base import SavedLayer, SavedState
from kvfork.backends.home import kvfork_home
from kvfork.backends.private_files import FILE_MODE, SECRET, open_private, own_folder, private_folder, secret
from kvfork.server.engine.cache.index import Index
from kvfork.server.engine.policy.entries import Entry

log = logging.getLogger("kvfork.disk")

KV_FORMAT_VERSION = "2"  # bump when the file layout or the saved-state rule changes: old files are then dropped
SUFFIX = ".safetensors"
LOCK = "lock"
# The tokenizer's files, the converter's record (backends/default_model.py: the converter's version), and a
# vision model's image processor's (the pixels its images' states were computed from: backends/vision)
_MODEL_FILES = ("kvfork-converted.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                "preprocessor_config.json", "processor_config.json")
_GIVE_UP = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)  # the tier goes off


def kv_root() -> Path:
    """`$KVFORK_HOME/kv`."""
    return kvfork_home() / "kv"


def fingerprint(model_dir: str | Path, dtype: str, backend: str, kv_dtype: str = "") -> str:
    """What a file's KV state depends on: the model's config, tokenizer, converter version and weights (their
    safetensors headers and sizes, not gigabytes), dtype, KV storage (ModelInfo.kv_dtype, and whether computed
    batch-invariantly), backend, KV format."""
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
    stored = dtype if kv_dtype in ("", dtype) else f"{dtype}, kv {kv_dtype}"  # --kv-cache-dtype auto: as before
    for label, value in (("dtype", stored), ("backend", backend), ("format", KV_FORMAT_VERSION)):
        feed(label, value.encode())
    return h.hexdigest()[:20]


def tier_secret(root: Path) -> bytes:
    """The key scopes are named under (api.Scope.digest): the secret beside `root` (in $KVFORK_HOME), so the
    files of a scope keep their name across restarts (backends/private_files.py: made once, 0600)."""
    return secret(root.parent / SECRET)


def entry_name(scope: str, tokens: Sequence[int]) -> str:
    """A file's name: a hash of its scope (a digest) and tokens."""
    h = hashlib.sha256(scope.encode())
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


def encode(state: SavedState, tokens: Sequence[int], scope: str, fp: str) -> bytes:
    tensors: dict[str, np.ndarray] = {}
    for i, layer in enumerate(state.layers):
        for j, a in enumerate(layer.arrays):
            tensors[f"layers.{i}.{layer.kind}.{j}.{layer.first}-{state.position}"] = np.ascontiguousarray(a)
    meta = {"kvfork_kv": KV_FORMAT_VERSION, "fingerprint": fp, "position": str(state.position),
            "tokens": json.dumps(list(tokens)), "scope": scope,
            "layers": json.dumps([[layer.kind, layer.first, len(layer.arrays)] for layer in state.layers]),
            "rope_shifts": json.dumps(state.rope_shifts)}
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
        shifts = tuple((int(slot), int(shift)) for slot, shift in json.loads(meta.get("rope_shifts", "[]")))
        return SavedState(position, tuple(layers), shifts), json.loads(meta["tokens"]), meta["scope"]
    except Exception as exc:
        raise CorruptFile(f"inconsistent: {exc!r}") from None


def read_header(path: Path) -> dict[str, str]:
    """A file's metadata, without reading its tensors (a link or another user's file: OSError)."""
    with os.fdopen(open_private(path, os.O_RDONLY), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 64 * 1024 * 1024:
            raise CorruptFile("header too large")
        meta = json.loads(f.read(n))["__metadata__"]
    if not isinstance(meta, dict):
        raise CorruptFile("no metadata")
    return meta


def header_entry(meta: dict[str, Any], fp: str) -> tuple[tuple[int, ...], str]:
    """(tokens, scope digest) a file's metadata says it holds; CorruptFile when they are not what we write."""
    if meta.get("kvfork_kv") != KV_FORMAT_VERSION or meta.get("fingerprint") != fp:
        raise CorruptFile("another model or format")
    tokens, scope = json.loads(meta["tokens"]), meta["scope"]
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens) or not isinstance(scope, str):
        raise CorruptFile("malformed tokens or scope")
    return tuple(tokens), scope


def _write_file(folder: Path, name: str, data: bytes) -> None:
    """Temporary file, fsync, rename, fsync of the folder: a crash leaves the old state or the new."""
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / f"{name}{SUFFIX}")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the tier ----


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
    fd = open_private(folder / LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("removing prefix cache file %s failed: %r", path.name, exc)


def _empty_folder(folder: Path) -> None:
    """Remove what the tier writes there (entries, temporaries, the lock), then the folder if empty. A link is
    removed itself (unlink never follows one)."""
    for path in folder.iterdir():
        if path.name.endswith((SUFFIX, ".tmp")) or path.name == LOCK:
            path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # something else lives there: left alone


class DiskTier:
    """One fingerprint folder and its worker thread; its files are entries of the index (tier "disk")."""

    def __init__(self, root: Path, fp: str, max_bytes: int, index: Index):
        """The tier of `fp` under `root`, its files indexed again from their headers; off (with one
        warning) when the folder cannot be made or locked."""
        self.folder, self.fp, self.max_bytes = root / fp, fp, max_bytes
        self._index = index
        self.pending_bytes = 0  # files being written: counted against the cap before they exist
        self.stats = DiskStats()
        self.on = False
        self._lock_fd: int | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvfork-disk")
        self._due = 0  # file work submitted whose answer has not run on the loop yet
        self._answered: asyncio.Event | None = None  # set as each answer runs (close waits on it)
        try:
            private_folder(root)
            private_folder(self.folder)
            self._lock_fd = _try_lock(self.folder)
            if self._lock_fd is None:
                log.warning("prefix cache disk tier off: another daemon uses %s", self.folder)
                return
            self.on = True
            self._rebuild()
            self._drop_other_fingerprints(root)
        except Exception as exc:  # the tier is optional: whatever stops it, serving goes on without it
            self._turn_off(exc)

    @property
    def nbytes(self) -> int:
        """Bytes of the files indexed."""
        return self._index.nbytes("disk")

    @property
    def files(self) -> int:
        return self._index.count("disk")

    def _rebuild(self) -> None:
        found = []
        for path in self.folder.iterdir():
            if path.name.endswith(".tmp"):  # a write a crash interrupted
                _unlink(path)
            elif path.name.endswith(SUFFIX):
                try:
                    tokens, scope = header_entry(read_header(path), self.fp)  # a link: refused, removed
                    st = path.lstat()
                    found.append((st.st_mtime, Entry("disk", scope, tokens, path.name.removesuffix(SUFFIX),
                                                     nbytes=st.st_size)))
                except Exception as exc:  # whatever a file holds, it is only ever that file's problem
                    log.warning("removed unreadable prefix cache file %s: %r", path.name, exc)
                    self.stats.corrupt += 1
                    _unlink(path)
        for _, entry in sorted(found, key=lambda item: item[0]):  # least recently written first
            self._index.add_file(entry)
        self._trim(0)

    def _drop_other_fingerprints(self, root: Path) -> None:
        for folder in root.iterdir():
            if folder == self.folder or not own_folder(folder) or not (folder / LOCK).exists():
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

    async def close(self) -> None:
        """Wait until every write under way has been answered on the loop (a spill at shutdown then
        replaces the files it should), then for the removals those answers asked for; let the folder go."""
        while self._due:
            self._answered = self._answered or asyncio.Event()
            self._answered.clear()
            await self._answered.wait()
        await asyncio.to_thread(self._pool.shutdown, True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- the files' entries (control loop) ----

    def worth(self, tokens: Sequence[int], scope: str) -> bool:
        """Whether an entry is worth writing: not when a file serves it already (refreshed instead):
        its own, or, on a model of full-attention layers only, one of a longer prompt it begins."""
        covering = self._index.covering_files(tokens, scope)
        for entry in covering:
            self._index.touch(entry)
        return not covering

    def touch(self, entry: Entry) -> None:
        self._index.touch(entry)

    def forget(self, entry: Entry) -> None:
        """Out of the index, and its file removed (a corrupt or missing one)."""
        self._index.drop(entry)
        self._remove_later(entry.owner)

    def _trim(self, room: int) -> None:
        """Evict least recently used files until `room` more bytes fit under the cap."""
        while self._index.count("disk") and self.nbytes + self.pending_bytes + room > self.max_bytes:
            entry = self._index.evict_oldest("disk")
            self.stats.evicted += 1
            self._remove_later(entry.owner)

    # ---- file work (worker thread), answered on the loop ----

    def write(self, state: SavedState, tokens: Sequence[int], scope: str, done: Callable[[bool], None]) -> None:
        """Encode and write `state`, of `scope` (a digest), on the worker thread; `done(written)` runs on the
        loop after."""
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
                entry = self._index.add_file(Entry("disk", scope, tokens, name, nbytes=result))
                self.stats.spilled += 1
                # files of prompts this one begins with serve nothing it does not: written once
                for other in self._index.entries("disk"):
                    if other.scope == entry.scope and other is not entry and self._index.serves(tokens, other.tokens):
                        self.forget(other)
                self._trim(0)
            done(not isinstance(result, BaseException))

        self._submit(loop, work, finish)

    def read(self, entry: Entry, done: Callable[[SavedState | None, str, float], None]) -> None:
        """Read and check `entry`'s file on the worker thread; `done(state or None, outcome, seconds)`
        runs on the loop (outcome: read, corrupt, missing, failed). A bad file is forgotten."""
        loop = asyncio.get_running_loop()

        def work() -> tuple[SavedState, float]:
            t0 = time.perf_counter()  # the read itself, not its wait behind other file work
            with os.fdopen(open_private(self.folder / f"{entry.owner}{SUFFIX}", os.O_RDONLY), "rb") as f:
                data = f.read()  # a link put in its place: refused, and the link removed (forget)
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
                log.warning("removed corrupt prefix cache file %s: %s", entry.owner, result)
                self.stats.corrupt += 1
                outcome = "corrupt"
            elif isinstance(result, FileNotFoundError):
                outcome = "missing"
            else:
                log.warning("reading prefix cache file %s failed: %r", entry.owner, result)
                self.stats.failed += 1
                outcome = "failed"
            self.forget(entry)
            done(None, outcome, 0.0)

        self._submit(loop, work, finish)

    def _submit(self, loop: asyncio.AbstractEventLoop, work: Callable[[], Any], finish: Callable[[Any], None]) -> None:
        def answer(result: Any) -> None:
            self._due -= 1
            try:
                finish(result)
            finally:
                if self._answered is not None:
                    self._answered.set()

        def run() -> None:
            try:
                result = work()
            except BaseException as exc:  # answered on the loop, whatever it was
                result = exc
            try:
                loop.call_soon_threadsafe(answer, result)
            except RuntimeError:  # the loop is closed: nobody waits for it any more
                pass

        self._due += 1
        try:
            self._pool.submit(run)
        except RuntimeError:  # closed
            answer(RuntimeError("the disk tier is closed"))

    def _remove_later(self, name: str) -> None:
        try:
            self._pool.submit(self._remove, name)
        except RuntimeError:  # closed: `close` answered every write first, so this is a caller after it; the
            pass  # folder is no longer ours (its lock is let go): the next start indexes the file again

    def _remove(self, name: str) -> None:
        _unlink(self.folder / f"{name}{SUFFIX}")


# ---- `kvfork cache` ----


def describe(root: Path) -> list[dict[str, Any]]:
    """Each fingerprint folder under `root`: entries, bytes, whether a daemon holds it."""
    out = []
    for folder in sorted(root.iterdir()) if own_folder(root) else ():
        if not own_folder(folder):
            continue
        files = [p for p in folder.iterdir() if p.name.endswith(SUFFIX) and p.is_file() and not p.is_symlink()]
        held = False
        if (folder / LOCK).exists():
            fd = _try_lock(folder)
            held = fd is None
            if fd is not None:
                os.close(fd)
        out.append({"fingerprint": folder.name, "entries": len(files), "bytes": sum(p.lstat().st_size for p in files),
                    "in_use": held})
    return out


def clear(root: Path) -> tuple[int, list[str]]:
    """Empty every fingerprint folder no daemon holds: (files removed, folders skipped as in use). A link or
    another user's folder, at `root` or under it, is never entered (so nothing it points to is removed)."""
    removed, skipped = 0, []
    if root.exists() and not own_folder(root):
        raise OSError(errno.EPERM, "a link, or not a folder of this user: not cleared", str(root))
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if not own_folder(folder):
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
