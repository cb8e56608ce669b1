"""Convert a GGUF into a Hugging Face folder (float32 weights) that mlx-lm and our torch backend load.

reader.py reads the file (checking it: a malformed one is refused in one sentence) and the `gguf`
package dequantizes each tensor (every type `gguf.quants` knows: F32, F16, BF16, Q4_0 ... Q8_0,
the K and IQ quants); backends/gguf/architectures.py says what each tensor and metadata key
becomes. Weights are written tensor by tensor into shards of at most `SHARD_BYTES`, so a large
model never sits in memory whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from safetensors.numpy import save_file

from kvfork.backends.gguf.architectures import ROPE_FREQS, as_checkpoint, hf_config, hf_name
from kvfork.backends.gguf.reader import GGUFFile, dequantized, read_gguf
from kvfork.backends.gguf.tokenizer import end_of_generation_ids, special_token_ids, write_tokenizer

# Bump whenever the converted folder would differ: cached folders with another version are rebuilt.
CONVERTER_VERSION = 2
SHARD_BYTES = 4 << 30

Log = Callable[[str], None]


def convert_gguf(gguf_path: Path, out_dir: Path, log: Log = print) -> None:
    """Write the model's safetensors, config.json, generation_config.json and tokenizer files into out_dir."""
    log(f"reading {gguf_path.name}")
    g = read_gguf(gguf_path)
    config = hf_config(g)
    ids = special_token_ids(g)
    config.update(vocab_size=len(g.meta["tokenizer.ggml.tokens"]), bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                  pad_token_id=ids["pad"])
    write_tokenizer(g, out_dir, config["max_position_embeddings"])  # a missing tokenizer fails before the long part
    names = [name for name in g.tensors if name != ROPE_FREQS]
    shards = _shards(g, names)
    log(f"dequantizing {len(names)} tensors to float32 into {len(shards)} safetensors file(s)")
    index: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        weights = {hf_name(g.arch, name): as_checkpoint(g, name, dequantized(g.tensors[name]), config)
                   for name in shard}
        save_file(weights, str(out_dir / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(weights, file))
    if len(shards) > 1:
        total = sum(4 * int(g.tensors[name].n_elements) for name in names)
        _write_json(out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": index})
    _write_json(out_dir / "config.json", config)
    # every id generation stops on (backends/model_info.py reads them beside config.json's EOS)
    eog = end_of_generation_ids(g)
    generation = {key: config[key] for key in ("bos_token_id", "pad_token_id")}
    _write_json(out_dir / "generation_config.json", dict(generation, eos_token_id=eog if len(eog) > 1 else eog[0]))


def _shards(g: GGUFFile, names: list[str]) -> list[list[str]]:
    """Tensors in file order, cut into runs of at most SHARD_BYTES as float32 (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n_bytes = 4 * int(g.tensors[name].n_elements)
        if shards[-1] and size + n_bytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n_bytes
    return shards


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


