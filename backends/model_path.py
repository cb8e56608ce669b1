"""Where kvfork keeps its files, and where a model lives: a local folder, or a Hugging Face hub id
fetched into the hub cache.

One resolver serves the launcher and every backend, so `--model org/name`
means the same folder to the tokenizer, MLX and torch.
"""

from __future__ import annotations

import os
from pathlib import Path


def kvfork_home() -> Path:
    """$KVFORK_HOME (default ~/.cache/kvfork): the default model under `models`, the disk tier under `kv`."""
    return Path(os.environ.get("KVFORK_HOME") or Path.home() / ".cache" / "kvfork").expanduser()

# What loading needs; never the other formats a hub repo may carry (GGUF, ONNX, ...).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve_model(name: str) -> Path:
    """The local folder for `name`; raises FileNotFoundError with a reason a user can act on."""
    local = Path(name).expanduser()
    if local.exists():
        return local
    if name.startswith(("/", ".", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"no model folder at {name} (pass a folder, or a hub id such as org/name)")
    from huggingface_hub import snapshot_download  # comes with transformers and mlx-lm

    try:
        # A hub id already in the cache resolves offline too.
        return Path(snapshot_download(name, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # the hub raises many types: offline, unknown repo, gated, ...
        raise FileNotFoundError(f"cannot fetch {name} from the Hugging Face hub: {type(e).__name__}") from e
