"""What a model folder says about generation, read in one place for every backend.

Both backends call `read_model_facts`, so one folder stops on the same EOS ids
and has the same context length whichever backend serves it.

Design rules:
- EOS ids: config.json (and its `text_config`), then generation_config.json,
  then the tokenizer's own EOS token, first seen first (as mlx-lm gathers them);
- context length: the first of `CONTEXT_KEYS` in config.json (or `text_config`);
  a config stating none gets `FALLBACK_CONTEXT`, the one fallback;
- generation defaults: generation_config.json's sampling fields, as published;
- vocabulary size: config.json's `vocab_size` (or `text_config`'s), the width of the logits, so that a
  request's token ids are checked before its model loads (None where the config states none);
- a RoPE scaling whose frequencies depend on the sequence's length (dynamic NTK) is refused
  here, for every backend: reused KV would not be what the model computes (backends/rope_scaling.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfork.backends import rope_scaling

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# A config that states no context: small and old models, for which 2,048 is the common size, and too
# small a context fails a request cleanly where too large a one runs the model past what it learned.
FALLBACK_CONTEXT = 2048
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelFacts:
    eos_token_ids: tuple[int, ...]
    context_length: int
    generation_defaults: dict[str, float] = field(default_factory=dict)
    vocab_size: int | None = None


def read_model_facts(folder: str | Path) -> ModelFacts:
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")
    return model_facts(config, generation, _tokenizer_eos(folder))


def model_facts(config: dict, generation: dict | None = None, tokenizer_eos: int | None = None) -> ModelFacts:
    """The facts from already-read files (a config alone: tools that build a model in memory)."""
    generation = generation or {}
    sources = (config, config.get("text_config") or {})
    for scaling in _rope_scalings(sources):
        reason = rope_scaling.length_refusal(scaling)
        if reason is not None:
            raise ValueError(reason)
    found: list[int] = []
    for value in (*(s.get("eos_token_id") for s in sources), generation.get("eos_token_id"), tokenizer_eos):
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v not in found:
                found.append(v)
    context = next((s[k] for s in sources for k in CONTEXT_KEYS if isinstance(s.get(k), int)), FALLBACK_CONTEXT)
    defaults = {k: float(generation[k]) for k in GENERATION_FIELDS if isinstance(generation.get(k), (int, float))}
    vocab = next((s["vocab_size"] for s in sources if isinstance(s.get("vocab_size"), int)), None)
    return ModelFacts(tuple(found), context, defaults, vocab)


def _rope_scalings(sources: tuple[dict, ...]) -> list[dict]:
    """Every RoPE scaling a config states: `rope_scaling`, `rope_parameters`, or one of those per layer kind."""
    found = []
    for source in sources:
        for value in (source.get("rope_scaling"), source.get("rope_parameters")):
            if isinstance(value, dict):
                nested = [v for v in value.values() if isinstance(v, dict)]
                found += nested or [value]
    return found


def _tokenizer_eos(folder: Path) -> int | None:
    """The id of tokenizer_config.json's `eos_token`, looked up in the tokenizer's own tables."""
    eos: Any = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    decoder = _read_json(folder / "tokenizer_config.json").get("added_tokens_decoder") or {}
    for token_id, token in decoder.items():
        if isinstance(token, dict) and token.get("content") == eos:
            return int(token_id)
    tokenizer = _read_json(folder / "tokenizer.json")
    for token in tokenizer.get("added_tokens") or ():
        if token.get("content") == eos:
            return int(token["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(eos), int):
        return vocab[eos]
    if isinstance(vocab, list):  # unigram: [piece, score] pairs, the id is the index
        return next((i for i, entry in enumerate(vocab) if entry and entry[0] == eos), None)
    return None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
