"""Debian packages a test needs beyond Python's: installed with apt when missing and the tests run as root (CI's
fresh machine); elsewhere the caller skips, saying which package to install."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def installed(programs: Sequence[str], packages: Sequence[str]) -> bool:
    """Whether each of `programs` is on PATH, after `apt-get install packages` where one was missing and this
    runs as root (waiting for another worker's apt to finish rather than failing on its lock)."""
    if all(shutil.which(p) for p in programs):
        return True
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=900", "install", "-y", *packages]
    for command in (install, ["apt-get", "-o", "DPkg::Lock::Timeout=900", "update"], install):
        subprocess.run(command, env=env, capture_output=True, timeout=900, check=False)
        if all(shutil.which(p) for p in programs):
            return True
    return False
