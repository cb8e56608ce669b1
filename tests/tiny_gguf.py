"""A tiny model folder (tiny_models.py) written again as a GGUF, as llama.cpp's converter writes one:
its `<arch>.*` keys, GGUF tensor names, llama's q/k rows permuted to interleaved pairs, the
byte-level tokenizer as tokens, types and merges, and the chat template."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, quants
from gguf.gguf_writer import GGUFValue
from safetensors.numpy import load_file

from tiny_models import CHATML

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GEMMA_NAMES = dict(_NAMES, post_attention_layernorm="post_attention_norm", pre_feedforward_layernorm="ffn_norm",
                    post_feedforward_layernorm="post_ffw_norm")
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_CONTROL, _NORMAL = 3, 1


def gguf_name(hf: str, model_type: str = "llama") -> str:
    base, kind = hf.rsplit(".", 1)
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{(_GEMMA_NAMES if model_type == 'gemma3_text' else _NAMES)[rest]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows (2, half) become (half, 2)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def stored(hf: str, value: np.ndarray, config: dict,
           quant: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A weight as the GGUF holds it: permuted for llama, gemma's norms with 1 added, quantized when 2-D (norms
    stay float32)."""
    if config["model_type"] == "gemma3_text" and hf.endswith("norm.weight"):
        value = value + np.float32(1.0)
    if config["model_type"] == "llama" and hf.endswith("q_proj.weight"):
        value = llama_cpp_permute(value, config["num_attention_heads"])
    elif config["model_type"] == "llama" and hf.endswith("k_proj.weight"):
        value = llama_cpp_permute(value, config["num_key_value_heads"])
    if value.ndim == 1 or quant == GGMLQuantizationType.F32:
        return value.astype(np.float32), GGMLQuantizationType.F32
    try:
        return quants.quantize(value, quant), quant
    except NotImplementedError:  # one the package cannot write (Q8_1: nor read): zero blocks, to be refused
        block, size = GGML_QUANT_SIZES[quant]
        return np.zeros((*value.shape[:-1], value.shape[-1] // block * size), np.uint8), quant


def write_gguf(folder: Path, out: Path, quant: GGMLQuantizationType = GGMLQuantizationType.F32,
               chat_template: str = CHATML, bos: str | None = None, tokenizer: bool | str = True,
               tensors: dict[str, np.ndarray] | None = None,
               replace: dict[str, tuple[Any, GGUFValueType]] | None = None, **keys) -> Path:
    """`folder` (a tiny model) as a GGUF at `out`; `bos`: a token the tokenizer prepends (`tokenizer`: False leaves
    the tokenizer out, "sentencepiece" writes `sentencepiece_vocab` with Gemma's turn template); `tensors`: more
    (float32) tensors by GGUF name; `replace`: full keys written as (value, type) instead (a token list that is
    an integer); `keys`: extra `<arch>.` metadata (value, or None to leave out)."""
    config = json.loads((folder / "config.json").read_text())
    arch = _ARCHS[config["model_type"]]
    writer = GGUFWriter(str(out), arch)
    fields = {"block_count": config["num_hidden_layers"], "context_length": config["max_position_embeddings"],
              "embedding_length": config["hidden_size"], "feed_forward_length": config["intermediate_size"],
              "attention.head_count": config["num_attention_heads"],
              "attention.head_count_kv": config["num_key_value_heads"], "attention.key_length": config["head_dim"],
              "attention.value_length": config["head_dim"],
              "attention.layer_norm_rms_epsilon": np.float32(config["rms_norm_eps"]),
              "rope.freq_base": np.float32(config["rope_theta"]), **keys}
    if arch == "gemma3":
        fields["attention.sliding_window"] = config["sliding_window"]
        writer.add_array("gemma3.attention.sliding_window_pattern",
                         [kind == "sliding_attention" for kind in config["layer_types"]])
    for key, value in fields.items():
        if value is None:
            continue
        put = writer.add_string if isinstance(value, str) else \
            writer.add_uint32 if isinstance(value, int) else writer.add_float32
        put(f"{arch}.{key}", value)
    if tokenizer == "sentencepiece":
        _add_sentencepiece(writer, config["vocab_size"])
    elif tokenizer:
        _add_tokenizer(writer, folder, chat_template, bos)
    for key, (value, kind) in (replace or {}).items():
        writer.kv_data[0][key] = GGUFValue(value, kind)
    for name, value in load_file(str(folder / "model.safetensors")).items():
        data, kind = stored(name, value, config, quant)
        raw_shape = data.shape if kind == GGMLQuantizationType.F32 else None
        writer.add_tensor(gguf_name(name, config["model_type"]), data, raw_shape=raw_shape, raw_dtype=kind)
    for name, value in (tensors or {}).items():
        writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: GGUFWriter, folder: Path, chat_template: str, bos: str | None) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")  # the tiny tokenizer's split: each digit alone, then GPT-2's
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL if t in special else _NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(bos is not None)
    if bos is not None:
        writer.add_bos_token_id(vocab[bos])
    writer.add_chat_template(chat_template)


GEMMA_TURNS = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
               "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_SP_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
_UNKNOWN, _BYTE = 2, 6


def sentencepiece_vocab(size: int) -> list[str]:
    """A SentencePiece vocabulary as a GGUF lists one: specials, the 256 byte fallbacks, then pieces
    ("\u2581" marks a word's start), `size` in all."""
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyzFPBG0123456789.,!?'"]
    # every prefix of a word's piece too: the merges transformers rebuilds pass through them
    pieces += [f"\u2581{w}"[:n] for w in _WORDS_FOR_PIECES for n in range(2, len(w) + 2)]
    pieces += [a + b for a in "aeiou" for b in "nrstlmdc"]
    vocab = _SP_SPECIAL + [f"<0x{i:02X}>" for i in range(256)] + list(dict.fromkeys(pieces))
    return (vocab + [f"<unused{i}>" for i in range(size)])[:size]


_WORDS_FOR_PIECES = ("the", "capital", "of", "France", "is", "Paris", "a", "to", "in", "city", "river", "model", "user",
                     "code", "test", "cache", "prefix", "token", "prompt", "answer", "question", "Berlin", "Germany")


def _add_sentencepiece(writer: GGUFWriter, size: int) -> None:
    tokens = sentencepiece_vocab(size)
    types = [_CONTROL if t in _SP_SPECIAL and t != "<unk>" else _UNKNOWN if t == "<unk>" else
             _BYTE if t.startswith("<0x") else _CONTROL if t.startswith("<unused") else _NORMAL for t in tokens]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<bos>"))
    writer.add_eos_token_id(tokens.index("<eos>"))  # as Gemma's files: its turns end with <end_of_turn>
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_pad_token_id(tokens.index("<pad>"))
    writer.add_add_bos_token(True)
    writer.add_chat_template(GEMMA_TURNS)


def gguf_text(text: str) -> bytes:
    """A GGUF string: its u64 length, then its UTF-8 bytes."""
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def handmade_gguf(out: Path, fields: list[tuple[str, GGUFValueType, bytes]], n_tensors: int = 0,
                  tail: bytes = b"") -> Path:
    """A GGUF written byte by byte, as GGUFWriter refuses to (a key twice, counts past the file's end):
    `fields` as (key, value type, the value's bytes), then `tail`."""
    header = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(fields))
    out.write_bytes(header + b"".join(gguf_text(k) + struct.pack("<I", kind) + v for k, kind, v in fields) + tail)
    return out
