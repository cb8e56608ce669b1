"""Where kvfork keeps its files: $KVFORK_HOME, holding the default model and GGUF conversions under
`models`, the disk tier under `kv` and their secret (backends/private_files.py), and the CPU's build of
kv_reading.c under `kernels` (backends/kv_reading.py).

Its own module, below everything that keeps files there: the resolver of model names
(model_path.py), the GGUF conversions it calls (gguf/cache.py), the disk tier and the tools.
"""

from __future__ import annotations

import os
from pathlib import Path


def kvfork_home() -> Path:
    """$KVFORK_HOME (default ~/.cache/kvfork): the default model under `models`, the disk tier under `kv`."""
    return Path(os.environ.get("KVFORK_HOME") or Path.home() / ".cache" / "kvfork").expanduser()
