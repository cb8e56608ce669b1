"""Where a model lives: a local folder, a Hugging Face hub id
fetched into the hub cache, or a GGUF file (local, or `org/name:file.gguf` on the hub) converted
once into a folder (backends/gguf/cache.py).

One resolver serves the launcher and every backend, so `--model org/name`
means the same folder to the tokenizer, MLX and torch.
"""

from __future__ import annotations

from pathlib import Path

# What loading needs; never the other formats a hub repo may carry (GGUF, ONNX, ...).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve_model(name: str) -> Path:
    """The local folder for `name`; raises FileNotFoundError with a reason a user can act on, and
    backends.gguf.reader.UnservableGGUF (a ValueError) for a GGUF kvfork cannot serve."""
    local = Path(name).expanduser()
    if local.is_file() and local.suffix.lower() == ".gguf":
        return _converted(local)
    if local.exists():
        return local
    hub_id, colon, file = name.partition(":")
    hub_like = not name.startswith(("/", ".", "~")) and hub_id.count("/") == 1
    if colon and hub_like and file.lower().endswith(".gguf"):
        return _converted(_hub_file(hub_id, file))
    if name.lower().endswith(".gguf"):
        raise FileNotFoundError(f"no GGUF file at {name} (a GGUF on the hub is named org/name:file.gguf)")
    if not hub_like or colon:
        raise FileNotFoundError(f"no model folder at {name} (pass a folder, a hub id such as org/name, "
                                "a .gguf file, or org/name:file.gguf)")
    from huggingface_hub import snapshot_download  # comes with transformers and mlx-lm

    try:
        # A hub id already in the cache resolves offline too.
        return Path(snapshot_download(name, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # the hub raises many types: offline, unknown repo, gated, ...
        raise FileNotFoundError(f"cannot fetch {name} from the Hugging Face hub: {type(e).__name__}") from e


def _hub_file(hub_id: str, file: str) -> Path:
    """One file of a hub repo, in the hub cache (a cached one resolves offline too)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(hub_id, file))
    except Exception as e:  # as snapshot_download: offline, unknown repo or file, gated, ...
        raise FileNotFoundError(f"cannot fetch {file} of {hub_id} from the Hugging Face hub: {type(e).__name__}") from e


def _converted(gguf: Path) -> Path:
    from kvfork.backends.gguf.cache import converted_folder  # reads with the gguf package, only for a GGUF

    return converted_folder(gguf)
