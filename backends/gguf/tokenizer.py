"""A GGUF's tokenizer -> tokenizer.json + tokenizer_config.json, built by transformers' GGUF integration.

A GGUF keeps the vocabulary, merges, token types and special ids as metadata, and names
its pre-tokenizer (`tokenizer.ggml.pre`), whose regex llama.cpp holds. transformers
rebuilds the Hugging Face tokenizer from those (`convert_gguf_tokenizer`) and knows the
split of the common names; a name it falls back on the GPT-2 split for would cut text
otherwise than the model was trained on, so kvfork adds the names it knows beside them
(`DIGIT_SPLITS`) and refuses any other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, pre_tokenizers, processors

from kvfork.backends.gguf.reader import GGUFFile, UnservableGGUF

_CONTROL = 3  # ggml token type of a special token

# llama.cpp runs "\p{N}" before the GPT-2 regex for these names; Hugging Face writes the same as
# Digits(individual) then ByteLevel: every digit is its own piece.
DIGIT_SPLITS = ("smollm", "starcoder")
GPT2_SPLITS = ("default", "gpt-2")  # the byte-level pre-tokenizer's own regex
# Control tokens that end a turn in the families' chat templates: llama.cpp stops on these as well as on the
# file's EOS (a Gemma file names <eos>, its turns end with <end_of_turn>), as their Hugging Face
# generation_config.json lists them beside EOS.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>")
NO_TOKENIZER = "the GGUF carries no tokenizer (tokenizer.ggml.model and tokenizer.ggml.tokens)"
# The type of every tokenizer key kvfork or transformers reads; the ids name tokens of the vocabulary.
KINDS = {"ggml.model": str, "ggml.pre": str, "ggml.tokens": list[str], "ggml.scores": list[float],
         "ggml.token_type": list[int], "ggml.merges": list[str], "ggml.precompiled_charsmap": list[int],
         "ggml.add_space_prefix": bool, "ggml.add_bos_token": bool, "ggml.add_eos_token": bool, "chat_template": str}
IDS = ("bos", "eos", "unknown", "padding", "eot", "eom")


def vocabulary(g: GGUFFile) -> list[str]:
    """The file's tokens, once every tokenizer key is checked: each of its type, the per-token lists as long
    as the vocabulary, and each special id one of its tokens."""
    kinds = KINDS | {f"ggml.{role}_token_id": int for role in IDS}
    for key, kind in kinds.items():
        g.value(f"tokenizer.{key}", kind=kind)
    tokens = g.value("tokenizer.ggml.tokens")
    if tokens is None:
        raise UnservableGGUF(NO_TOKENIZER)
    for key in ("scores", "token_type"):
        if len(g.value(f"tokenizer.ggml.{key}", tokens)) != len(tokens):
            raise UnservableGGUF(f"the GGUF's tokenizer.ggml.{key} does not give one value per token "
                                 f"of its {len(tokens)}")
    for role in IDS:
        token_id = g.value(f"tokenizer.ggml.{role}_token_id")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise UnservableGGUF(f"the GGUF's tokenizer.ggml.{role}_token_id is {token_id}, not a token of its "
                                 f"vocabulary of {len(tokens)}")
    return tokens


def _tokenizer_dict(g: GGUFFile) -> dict[str, Any]:
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING

    vocabulary(g)
    found = {name: g.meta[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
             if f"tokenizer.{key}" in g.meta}
    if "tokens" not in found or "tokenizer_type" not in found:
        raise UnservableGGUF(NO_TOKENIZER)
    return found


def _check_split(tokenizer_dict: dict[str, Any]) -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    if tokenizer_dict["tokenizer_type"] != "gpt2":
        return  # sentencepiece and unigram vocabularies carry no split regex
    pre = tokenizer_dict.get("pre_tokenizer_type", "default")
    if pre not in (*GPT2_SPLITS, *DIGIT_SPLITS, *GGUF_PRE_TOKENIZER_SPLITS):
        raise UnservableGGUF(f"the GGUF's pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one whose split "
                             "kvfork or transformers knows")


def special_token_ids(g: GGUFFile) -> dict[str, int | None]:
    """bos/eos/unk/pad ids the GGUF names (pad falls back to eos)."""
    vocabulary(g)
    ids = {role: g.meta.get(f"tokenizer.ggml.{key}_token_id")
           for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    if ids["eos"] is None:
        raise UnservableGGUF("the GGUF names no end-of-sequence token (tokenizer.ggml.eos_token_id)")
    if ids["pad"] is None:
        ids["pad"] = ids["eos"]
    return ids


def within_vocabulary(backend: Tokenizer, size: int) -> Tokenizer:
    """The tokenizer less the tokens its transformers class added past the file's vocabulary (a class's
    default special tokens, as GPT-2's `<|endoftext|>` beside Llama 3's vocabulary): text naming one would
    otherwise encode to an id the model has no embedding for."""
    data = json.loads(backend.to_str())
    kept = [token for token in data["added_tokens"] if token["id"] < size]
    if len(kept) == len(data["added_tokens"]):
        return backend
    return Tokenizer.from_str(json.dumps(dict(data, added_tokens=kept)))


def _prepend(backend: Tokenizer, token: str, token_id: int) -> None:
    """BOS before every encoded text, in tokenizer.json itself: the generic tokenizer class reads no
    `add_bos_token` (as Llama 3's own tokenizer.json does it)."""
    template = processors.TemplateProcessing(single=f"{token} $A", pair=f"{token} $A {token} $B",
                                             special_tokens=[(token, token_id)])
    backend.post_processor = template if backend.post_processor is None else \
        processors.Sequence([backend.post_processor, template])


def end_of_generation_ids(g: GGUFFile) -> list[int]:
    """EOS, the end-of-turn and end-of-message ids the file names, then its end-of-turn control tokens."""
    found = [special_token_ids(g)["eos"]]
    found += [g.meta[f"tokenizer.ggml.{key}_token_id"] for key in ("eot", "eom")
              if f"tokenizer.ggml.{key}_token_id" in g.meta]
    types = g.meta.get("tokenizer.ggml.token_type") or ()
    found += [i for i, (token, kind) in enumerate(zip(g.meta["tokenizer.ggml.tokens"], types))
              if kind == _CONTROL and token in END_OF_TURN]
    return list(dict.fromkeys(found))


def write_tokenizer(g: GGUFFile, out_dir: Path, context_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens by name, BOS policy, the chat template)."""
    from transformers.integrations.gguf import convert_gguf_tokenizer

    tokenizer_dict = _tokenizer_dict(g)
    _check_split(tokenizer_dict)
    try:
        backend, _ = convert_gguf_tokenizer(g.arch, tokenizer_dict)
    except Exception as e:  # the file's vocabulary, fed to transformers and tokenizers: any failure is its own
        raise UnservableGGUF(f"transformers cannot build the GGUF's tokenizer ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    backend = within_vocabulary(backend, len(tokenizer_dict["tokens"]))
    if tokenizer_dict.get("pre_tokenizer_type") in DIGIT_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokens = tokenizer_dict["tokens"]
    # llama.cpp prepends BOS to a sentencepiece vocabulary that does not say otherwise
    add_bos = bool(g.meta.get("tokenizer.ggml.add_bos_token", tokenizer_dict["tokenizer_type"] == "llama"))
    bos = special_token_ids(g)["bos"]
    if add_bos and bos is not None:
        _prepend(backend, tokens[bos], bos)
    backend.save(str(out_dir / "tokenizer.json"))
    config: dict[str, Any] = {
        # The generic class loads tokenizer.json as written; named classes may rebuild parts of it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": bool(g.meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    for role, token_id in special_token_ids(g).items():
        config[f"{role}_token"] = tokens[token_id] if token_id is not None else None
    if "tokenizer.chat_template" in g.meta:
        config["chat_template"] = g.meta["tokenizer.chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
