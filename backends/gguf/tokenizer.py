"""GGUF tokenizer metadata -> tokenizer.json + tokenizer_config.json.

A GGUF keeps a byte-level BPE as token strings, token types and merges; the
pre-tokenizer is only named (`tokenizer.ggml.pre`) and llama.cpp holds the
regex for each name. We rebuild the Hugging Face pipeline that name stands for,
so the converted tokenizer splits text exactly as the original did.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# ggml token types: 1 normal, 3 control (special), 4 user defined (added, not special).
_CONTROL, _USER_DEFINED = 3, 4


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    # llama.cpp runs "\p{N}" before the GPT-2 regex for these names; Hugging Face
    # writes the same as Digits(individual) then ByteLevel: every digit is its own piece.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# tokenizer.ggml.pre -> the Hugging Face pre-tokenizer it was converted from.
PRE_TOKENIZERS = {
    "gpt-2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
}


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to the one the GGUF was made from."""
    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) tokenizers convert, not {meta['tokenizer.ggml.model']!r}")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unknown GGUF pre-tokenizer {pre!r}; known: {sorted(PRE_TOKENIZERS)}")
    if meta.get("tokenizer.ggml.add_bos_token", False):
        raise ValueError("GGUF tokenizers that prepend BOS are not supported")

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta["tokenizer.ggml.token_type"]
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    if any(len(pair) != 2 for pair in merges):
        raise ValueError("a GGUF merge does not split into two byte-level tokens")

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens(
        [
            AddedToken(token, special=kind == _CONTROL, normalized=False)
            for token, kind in zip(tokens, types)
            if kind in (_CONTROL, _USER_DEFINED)
        ]
    )
    return tokenizer


def special_token_ids(meta: dict[str, Any]) -> dict[str, int]:
    """bos/eos/unk/pad ids the GGUF names (pad falls back to eos)."""
    ids = {
        role: meta[f"tokenizer.ggml.{key}_token_id"]
        for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if f"tokenizer.ggml.{key}_token_id" in meta
    }
    ids.setdefault("pad", ids["eos"])
    return ids


def tokenizer_config(meta: dict[str, Any], context_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by name plus the GGUF's chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        # The generic class loads tokenizer.json as written; named classes may rebuild parts of it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    for role, token_id in special_token_ids(meta).items():
        config[f"{role}_token"] = tokens[token_id]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config
