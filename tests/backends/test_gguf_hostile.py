"""A malformed GGUF is refused in one sentence, at once: counts past the file's end, arrays of arrays, a key
stated twice, a special id past the vocabulary, a key of the wrong type. The files are written here, most
byte by byte (tiny_gguf.handmade_gguf), as no writer would make them. A conversion folder someone planted
is never served."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import subprocess
import sys

import pytest
from gguf import GGUFValueType as V
from tiny_gguf import gguf_text, handmade_gguf, write_gguf
from tiny_models import write_model

from kvfork.backends.gguf.cache import STAMP, gguf_stamp
from kvfork.backends.gguf.reader import MAX_ARRAY_ITEMS, MAX_STRING_ARRAY_BYTES, UnservableGGUF, read_gguf
from kvfork.backends.model_path import resolve_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HUGE = 2**40
LLAMA = ("general.architecture", V.STRING, gguf_text("llama"))


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _padded(path, size=100):
    """The file grown to `size` bytes with zeros: room for nothing it declares."""
    with path.open("ab") as f:
        f.write(bytes(max(0, size - path.stat().st_size)))
    return path


@pytest.mark.parametrize("field, reason", [
    (("tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQ", V.STRING, HUGE)),
     f"declares {HUGE} strings in tokenizer.ggml.tokens, more than its remaining"),
    (("tokenizer.ggml.scores", V.ARRAY, struct.pack("<IQ", V.FLOAT32, HUGE)),
     f"declares {HUGE} items in tokenizer.ggml.scores"),
    (("general.name", V.STRING, struct.pack("<Q", HUGE)), f"declares {HUGE} bytes of general.name"),
])
def test_a_count_past_the_end_is_refused_before_reading(tmp_path, field, reason):
    """A 100-byte file declaring 2^40 items (the gguf package's reader loops over them)."""
    path = _padded(handmade_gguf(tmp_path / "huge.gguf", [LLAMA, field]))
    with pytest.raises(UnservableGGUF, match=reason):
        read_gguf(path)


@pytest.mark.parametrize("counts, reason", [((HUGE, 0), f"declares {HUGE} tensors"),
                                            ((0, HUGE), f"declares {HUGE} metadata keys")])
def test_tensor_and_key_counts_past_the_end_are_refused(tmp_path, counts, reason):
    path = tmp_path / "counts.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, *counts) + bytes(76))
    with pytest.raises(UnservableGGUF, match=reason):
        read_gguf(path)


def _many_tokens(tmp_path):
    """A vocabulary of one token more than MAX_ARRAY_ITEMS, each empty: the file holds their lengths."""
    tokens = ("tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQ", V.STRING, MAX_ARRAY_ITEMS + 1))
    return _padded(handmade_gguf(tmp_path / "many.gguf", [LLAMA, tokens]), 8 * (MAX_ARRAY_ITEMS + 1) + 200)


def test_a_vocabulary_past_the_bounds_is_refused_before_it_is_built(tmp_path):
    """More items than MAX_ARRAY_ITEMS, or a string array past MAX_STRING_ARRAY_BYTES, far above any model's
    vocabulary: transformers would build the tokenizer from them item by item (26 MB of tokens took 11 s)."""
    with pytest.raises(UnservableGGUF, match="tokenizer.ggml.tokens holds 1,048,577 items; kvfork reads at most "
                                             "1,048,576"):
        read_gguf(_many_tokens(tmp_path))
    scores = ("tokenizer.ggml.scores", V.ARRAY, struct.pack("<IQ", V.FLOAT32, MAX_ARRAY_ITEMS + 1))
    with pytest.raises(UnservableGGUF, match="tokenizer.ggml.scores holds 1,048,577 items"):
        read_gguf(_padded(handmade_gguf(tmp_path / "scores.gguf", [LLAMA, scores]), 4 * (MAX_ARRAY_ITEMS + 2) + 200))
    half = MAX_STRING_ARRAY_BYTES // 2
    two = struct.pack("<IQ", V.STRING, 2) + (struct.pack("<Q", half) + b"a" * half) * 2
    merges = ("tokenizer.ggml.merges", V.ARRAY, two)
    with pytest.raises(UnservableGGUF, match="tokenizer.ggml.merges takes more than 32 MiB"):
        read_gguf(handmade_gguf(tmp_path / "merges.gguf", [LLAMA, merges]))


def test_a_tensor_past_the_end_is_refused(tmp_path):
    entry = gguf_text("token_embd.weight") + struct.pack("<I2QIQ", 2, 64, 64, 0, 0)  # 16 KiB of F32, none written
    with pytest.raises(UnservableGGUF, match="tensor token_embd.weight lies past the end of the file"):
        read_gguf(handmade_gguf(tmp_path / "short.gguf", [LLAMA], n_tensors=1, tail=entry))


def test_arrays_of_arrays_are_refused_not_followed(tmp_path):
    """Nested 3,000 deep: the gguf package's reader recursed into them (RecursionError)."""
    nested = struct.pack("<IQ", V.ARRAY, 1) * 3000 + struct.pack("<IQ", V.UINT8, 0)
    with pytest.raises(UnservableGGUF, match="general.nested is an array of arrays"):
        read_gguf(handmade_gguf(tmp_path / "nested.gguf", [LLAMA, ("general.nested", V.ARRAY, nested)]))


def test_a_key_stated_twice_is_refused(tmp_path):
    with pytest.raises(UnservableGGUF, match="the GGUF states general.architecture twice"):
        read_gguf(handmade_gguf(tmp_path / "twice.gguf", [LLAMA, LLAMA]))


def test_text_that_is_not_utf8_is_refused(tmp_path):
    name = ("general.name", V.STRING, struct.pack("<Q", 2) + b"\xff\xfe")
    with pytest.raises(UnservableGGUF, match="general.name is not UTF-8 text"):
        read_gguf(handmade_gguf(tmp_path / "bytes.gguf", [LLAMA, name]))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("hostile") / "hf", "llama")


@pytest.mark.parametrize("written, reason", [
    (dict(replace={"tokenizer.ggml.eos_token_id": (70000, V.UINT32)}),
     "tokenizer.ggml.eos_token_id is 70000, not a token of its vocabulary"),  # was an IndexError
    (dict(replace={"tokenizer.ggml.tokens": (5, V.UINT32)}),
     "tokenizer.ggml.tokens is an integer where kvfork reads a list of strings"),  # was a TypeError
    (dict(replace={"tokenizer.ggml.token_type": (["1"], V.ARRAY)}),
     "tokenizer.ggml.token_type is a list of strings where kvfork reads a list of integers"),
    (dict(replace={"tokenizer.ggml.token_type": ([1, 1], V.ARRAY)}),
     "tokenizer.ggml.token_type does not give one value per token"),
    ({"attention.head_count": "four"}, "llama.attention.head_count is a string where kvfork reads an integer"),
    ({"attention.head_count": 0}, "llama.attention.head_count is 0, where a positive count belongs"),
    ({"block_count": 2**31}, "states 2147483648 blocks \\(llama.block_count\\) but holds tensors of 2"),
    ({"attention.head_count": 7}, "blk.0.attn_q.weight has 64 rows, not a pair of halves for each of its 7 heads"),
    (dict(replace={"tokenizer.ggml.merges": (["abc"], V.ARRAY)}),  # was a TypeError from tokenizers
     "transformers cannot build the GGUF's tokenizer \\(TypeError"),
])
def test_a_value_a_model_cannot_have_is_refused(tmp_path, folder, written, reason):
    path = write_gguf(folder, tmp_path / "odd.gguf", **written)
    with pytest.raises(UnservableGGUF, match=reason):
        resolve_model(str(path))


def _nested(tmp_path):
    nested = struct.pack("<IQ", V.ARRAY, 1) * 3000 + struct.pack("<IQ", V.UINT8, 0)
    return handmade_gguf(tmp_path / "nested.gguf", [LLAMA, ("general.nested", V.ARRAY, nested)])


@pytest.mark.parametrize("make, said", [
    (_nested, "the GGUF's general.nested is an array of arrays, which no GGUF model holds (llama.cpp refuses them "
              "too)"),
    (_many_tokens, "the GGUF's tokenizer.ggml.tokens holds 1,048,577 items; kvfork reads at most 1,048,576 (4 "
                   "times the largest vocabulary)"),
])
def test_serve_refuses_a_malformed_gguf_in_one_line(tmp_path, make, said):
    done = subprocess.run([sys.executable, "-m", "kvfork.server.cli", "serve", "--model", str(make(tmp_path))],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, KVFORK_HOME=str(tmp_path / "home")))
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("kvfork: gguf: ")]
    assert done.returncode == 2 and lines == [f"kvfork serve: error: --model: {said}"]


def test_a_planted_conversion_is_never_served(tmp_path, folder, home):
    """A folder at the name a digest of the file's public facts (path, size, mtime) gives, stamped as a current
    conversion: the conversion's folder is named under the home's secret instead, in 0700 folders."""
    gguf = write_gguf(folder, tmp_path / "tiny.gguf")
    stamp = gguf_stamp(gguf.resolve())
    public = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
    planted = home / "models" / "gguf" / public / gguf.stem
    planted.mkdir(parents=True)
    (planted / STAMP).write_text(json.dumps(stamp))
    (planted / "config.json").write_text('{"model_type": "planted"}')
    converted = resolve_model(str(gguf))
    assert converted != planted and json.loads((converted / "config.json").read_text())["model_type"] == "llama"
    for private in (converted.parent, converted.parent.parent):
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert resolve_model(str(gguf)) == converted  # found again: the name is stable under one secret


def test_a_conversion_folder_that_is_a_link_is_refused(tmp_path, folder, home):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (home / "models").mkdir(parents=True)
    (home / "models" / "gguf").symlink_to(elsewhere)
    with pytest.raises(UnservableGGUF, match="no private folder for the conversion under"):
        resolve_model(str(write_gguf(folder, tmp_path / "tiny.gguf")))
    assert not any(elsewhere.iterdir())
