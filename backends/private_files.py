"""Files only this user may read or change: a secret made once, files opened without following a link,
folders made 0700.

The disk tier (server/engine/cache/disk.py) names a scope's files by an HMAC under the secret, and a GGUF's
conversion (backends/gguf/cache.py) its folder: names no one without the secret can compute, in
folders no one else can enter or plant into.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("kvfork.private")

SECRET = "kv-secret"  # in $KVFORK_HOME, beside the kv folder: the disk tier's and the GGUF conversions' key
FILE_MODE, FOLDER_MODE = 0o600, 0o700


def secret(path: Path) -> bytes:
    """32 random bytes made at first use, 0600 at `path`. It is written to a temporary file and linked into
    place whole: two daemons starting at once agree (the first link wins, the other reads it), and a crash
    never leaves a short one. One that is not 32 bytes, a link or another user's is replaced, with a
    warning. OSError when it cannot be made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            return _read_secret(path)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("replacing the secret %s (%s): the prefix cache's files and the GGUF conversions named "
                        "under the old one are not reused", path, exc)
            path.unlink(missing_ok=True)  # the link or file itself, never what a link points to
        try:
            _link_new_secret(path)
        except FileExistsError:  # another daemon's landed first: read it
            pass
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    fd = open_private(path, os.O_RDONLY)
    try:
        value = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(value) != 32:
        raise ValueError(f"it holds {len(value)} bytes, not 32")
    return value


def _link_new_secret(path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.write(fd, os.urandom(32))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # FileExistsError when another daemon's is there
    finally:
        tmp.unlink(missing_ok=True)


def open_private(path: Path, flags: int) -> int:
    """A file of ours, opened without following a link (ELOOP: OSError) and made 0600; OSError when it is not
    a regular file this user owns."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, "not a regular file of this user", str(path))
        if stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)  # one written before the rule was 0644
    except BaseException:
        os.close(fd)
        raise
    return fd


def own_folder(folder: Path) -> bool:
    """Whether `folder` is a folder (not a link to one) this user owns."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def private_folder(folder: Path) -> None:
    """`folder` (and any parent it needs) made 0700; one made before the rule is narrowed. OSError when it is a
    link or another user's."""
    folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    if not own_folder(folder):
        raise OSError(errno.EPERM, "a link, or not a folder of this user: not used", str(folder))
    os.chmod(folder, FOLDER_MODE)
