"""`--model x.gguf`: a GGUF read (backends/gguf/reader.py), converted once into a folder both backends load.

A tiny llama and qwen3 written as GGUF (tiny_gguf.py) convert back to exactly the weights, config and
tokenizer they were written from, so each backend gives the same greedy tokens from either; a quantised
one serves a chat completion over HTTP; a GGUF that cannot be served gets one sentence, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import aiohttp
import numpy as np
import pytest
from backend_fixtures import continue_greedy, fresh, load, logits_np, prompt, release_all
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants
from safetensors.numpy import load_file
from tiny_gguf import gguf_name, llama_cpp_permute, write_gguf
from tiny_models import write_model
from tolerance import assert_dequantized_close

from kvfork.backends import create_backend
from kvfork.backends.gguf.architectures import unpermute_rope
from kvfork.backends.gguf.reader import UnservableGGUF, dequantized, read_gguf
from kvfork.backends.model_info import read_model_facts
from kvfork.backends.model_path import resolve_model
from http_daemon import chat_body, serving

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BACKENDS = ("mlx", "torch")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Converted folders go to a KVFORK_HOME of the test's own."""
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# qwen2: llama's shapes with q/k/v biases
QWEN2 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"])


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def pair(request, tmp_path_factory):
    """(safetensors folder, GGUF file) of one tiny model."""
    root = tmp_path_factory.mktemp(request.param)
    folder = write_model(root / "hf", "llama", **QWEN2) if request.param == "qwen2" else \
        write_model(root / "hf", request.param)
    return folder, write_gguf(folder, root / f"tiny-{request.param}.gguf")


def test_converts_back_to_the_same_weights_config_and_tokenizer(pair):
    folder, gguf = pair
    converted = resolve_model(str(gguf))
    assert converted.name == gguf.stem and resolve_model(str(gguf)) == converted  # once: found again
    want, got = load_file(str(folder / "model.safetensors")), load_file(str(converted / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        if "gemma" in gguf.name and name.endswith("norm.weight"):  # the file holds 1 + w, rounded to float32
            want[name] = (want[name] + np.float32(1)) - np.float32(1)
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    original, config = (json.loads((f / "config.json").read_text()) for f in (folder, converted))
    for key in ("model_type", "hidden_size", "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps",
                "max_position_embeddings", "vocab_size", "tie_word_embeddings", "eos_token_id"):
        assert config[key] == original[key], key
    from transformers import AutoTokenizer

    theirs, ours = AutoTokenizer.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(converted))
    messages = [{"role": "user", "content": "the capital of France in 2024 is Paris, isn't it?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(rendered, add_special_tokens=False) == theirs.encode(rendered, add_special_tokens=False)
    assert ours.encode("year 2024")[-4:] == [ours.convert_tokens_to_ids(d) for d in "2024"]  # smollm's digit split
    assert len(ours) == config["vocab_size"]  # no token past the file's vocabulary
    # generation stops on EOS (<|im_end|>) and on the vocabulary's other end-of-turn control token, as llama.cpp does
    assert read_model_facts(converted).eos_token_ids == (2, ours.convert_tokens_to_ids("<|endoftext|>"))


def test_no_token_past_the_vocabulary():
    """transformers' byte-level class adds GPT-2's `<|endoftext|>` to a vocabulary without it (Llama 3's)."""
    from kvfork.backends.gguf.tokenizer import within_vocabulary
    from transformers.integrations.gguf import convert_gguf_tokenizer

    tokens = ["a", "b", "ab", "<|end_of_text|>"]
    built, _ = convert_gguf_tokenizer("llama", {"tokenizer_type": "gpt2", "tokens": tokens, "token_type": [1, 1, 1, 3],
                                                "merges": ["a b"], "eos_token_id": 3})
    assert built.get_vocab_size(with_added_tokens=True) == 5  # the case guarded against
    kept = within_vocabulary(built, len(tokens))
    assert kept.get_vocab_size(with_added_tokens=True) == 4 and kept.encode("ab<|end_of_text|>").ids == [2, 3]


@pytest.mark.parametrize("name", BACKENDS)
def test_same_greedy_tokens_as_safetensors(pair, name):
    """Equal weights on one backend run the same kernels on the same shapes: bit-equal logits."""
    if name == "mlx":
        pytest.importorskip("mlx_lm")
    folder, gguf = pair
    answers = []
    for source in (str(folder), str(resolve_model(str(gguf)))):
        b = load(name, source)
        session, logits = fresh(b, prompt(40))
        answers.append(continue_greedy(b, session, logits, 10))
        release_all(b, session)
    assert answers[0][0] == answers[1][0]
    np.testing.assert_array_equal(np.stack(answers[0][1]), np.stack(answers[1][1]))


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_0])
def test_quantised_weights_are_the_reference_dequantization(tmp_path, quant):
    folder = write_model(tmp_path / "hf", "llama")
    converted = resolve_model(str(write_gguf(folder, tmp_path / f"tiny-{quant.name}.gguf", quant)))
    want, got = load_file(str(folder / "model.safetensors")), load_file(str(converted / "model.safetensors"))
    q = want["model.layers.0.self_attn.q_proj.weight"]
    reference = quants.dequantize(quants.quantize(llama_cpp_permute(q, 4), quant), quant)
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.weight"], unpermute_rope(reference, 4))
    up = "model.layers.0.mlp.up_proj.weight"
    assert not np.array_equal(got[up], want[up])
    assert_dequantized_close(got[up], want[up], quant.name)


@pytest.mark.parametrize("name", BACKENDS)
async def test_quantised_gguf_serves_a_chat_completion(tmp_path, name):
    if name == "mlx":
        pytest.importorskip("mlx_lm")
    gguf = write_gguf(write_model(tmp_path / "hf", "qwen3"), tmp_path / "tiny-qwen3-Q8_0.gguf", Q.Q8_0)
    model = str(resolve_model(str(gguf)))
    async with serving(model, create_backend(name)) as daemon, aiohttp.ClientSession() as http:
        async with http.post(f"{daemon.url}/v1/chat/completions", json=chat_body(max_tokens=8)) as r:
            body = await r.json()
        async with http.get(f"{daemon.url}/v1/models") as r:
            models = await r.json()
    assert r.status == 200 and body["usage"]["completion_tokens"] > 0, body
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert [m["id"] for m in models["data"]] == ["tiny-qwen3-Q8_0"]


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_undoes_llama_cpp_permutation(n_heads):
    weight = np.arange(n_heads * 8 * 5, dtype=np.float32).reshape(n_heads * 8, 5)
    permuted = llama_cpp_permute(weight, n_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rope(permuted, n_heads), weight)


def test_every_type_comes_back_in_row_major_shape(tmp_path):
    path = tmp_path / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    values = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    kinds = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0)
    for kind in kinds:
        data = values if kind == Q.F32 else values.astype(np.float16) if kind == Q.F16 else \
            quants.quantize(values, kind)
        writer.add_tensor(f"{kind.name}.weight", data, raw_dtype=kind)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    g = read_gguf(path)
    for kind in kinds:
        got = dequantized(g.tensors[f"{kind.name}.weight"])
        assert got.dtype == np.float32 and got.shape == (8, 96), kind
        assert_dequantized_close(got, values, kind.name)


def test_k_quants_come_back_as_the_gguf_package_computes_them(tmp_path):
    """K quants (blocks of 256) the package reads but cannot write: random blocks with small float16 scales."""
    rng = np.random.default_rng(1)
    layouts = {Q.Q4_K: (slice(0, 4), 144), Q.Q6_K: (slice(208, 210), 210)}  # where each block's f16 scales sit
    blocks = {}
    writer = GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for kind, (scales, size) in layouts.items():
        raw = rng.integers(0, 256, (8, size), dtype=np.uint8)
        raw[:, scales] = np.full((8, (scales.stop - scales.start) // 2), 0.01, np.float16).view(np.uint8)
        blocks[kind] = raw
        writer.add_tensor(f"{kind.name}.weight", raw, raw_shape=raw.shape, raw_dtype=kind)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    g = read_gguf(tmp_path / "k.gguf")
    for kind, raw in blocks.items():
        got = dequantized(g.tensors[f"{kind.name}.weight"])
        assert got.shape == (8, 256) and np.isfinite(got).all() and np.abs(got).max() > 0, kind
        np.testing.assert_array_equal(got, quants.dequantize(raw, kind), err_msg=kind.name)


def test_hub_gguf_is_one_named_file(tmp_path, monkeypatch, pair):
    """org/name:file.gguf fetches that one file through the hub cache, then converts it like a local one."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, file: asked.append((repo, file)) or str(pair[1]))
    assert resolve_model("some-org/some-model-GGUF:tiny.gguf").name == pair[1].stem
    assert asked == [("some-org/some-model-GGUF", "tiny.gguf")]


def test_hub_gguf_unavailable_offline_names_the_file(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="cannot fetch m-Q4_0.gguf of no-such-org/m from the Hugging Face hub"):
        resolve_model("no-such-org/m:m-Q4_0.gguf")
    with pytest.raises(FileNotFoundError, match=r"no GGUF file at /no/such\.gguf"):
        resolve_model("/no/such.gguf")


def _rope_freqs(factors_of) -> dict[str, np.ndarray]:
    theta, dim = 10000.0, 16
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    return {"rope_freqs.weight": factors_of(inv)}


def _llama3_factors(inv: np.ndarray) -> np.ndarray:
    """As llama.cpp's converter writes Llama 3.1's scaling (factor 8, low 1, high 4, original context 8192)."""
    wavelen = 2 * np.pi / inv
    smooth = (8192 / wavelen - 1) / (4 - 1)
    return np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth)))


@pytest.mark.parametrize("keys, tensors, want", [
    ({}, _rope_freqs(_llama3_factors), {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 1024}, {},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, {}, {"rope_type": "linear", "factor": 2.0}),
])
def test_rope_scaling_is_read_into_the_config(tmp_path, keys, tensors, want):
    gguf = write_gguf(write_model(tmp_path / "hf", "llama"), tmp_path / "scaled.gguf", tensors=tensors, **keys)
    converted = resolve_model(str(gguf))
    assert json.loads((converted / "config.json").read_text())["rope_scaling"] == want
    assert "rope_freqs.weight" not in load_file(str(converted / "model.safetensors"))


def _raw_gguf(path, arch):
    writer = GGUFWriter(str(path), arch)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    return path


def _bad_ggufs(root):
    root.mkdir(exist_ok=True)
    folder = write_model(root / "hf", "llama")
    (root / "text.gguf").write_text("not a gguf")
    return {
        "architecture 'mamba' is not one kvfork serves": _raw_gguf(root / "mamba.gguf", "mamba"),
        "carries no tokenizer": write_gguf(folder, root / "untokenized.gguf", tokenizer=False),
        "stored as Q8_1, a quantisation the gguf package cannot dequantize": write_gguf(
            folder, root / "q81.gguf", Q.Q8_1),
        "is not a GGUF file": root / "text.gguf",
        "is one part of a split GGUF": write_gguf(folder, root / "m-00001-of-00002.gguf"),
        "lacks llama.feed_forward_length": write_gguf(folder, root / "no-ffn.gguf", feed_forward_length=None),
        "rope_freqs factors are not Llama 3's": write_gguf(folder, root / "freqs.gguf",
                                                           tensors=_rope_freqs(lambda inv: 1.0 + inv)),
    }


def test_a_gguf_that_cannot_be_served_names_what_is_missing(tmp_path):
    for reason, path in _bad_ggufs(tmp_path / "bad").items():
        with pytest.raises(UnservableGGUF, match=reason):
            resolve_model(str(path))


def test_serve_exits_2_with_one_sentence(tmp_path):
    path = _raw_gguf(tmp_path / "mamba.gguf", "mamba")
    done = subprocess.run([sys.executable, "-m", "kvfork.server.cli", "serve", "--model", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, KVFORK_HOME=str(tmp_path / "home")))
    assert done.returncode == 2
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("kvfork: gguf: ")]
    assert lines == ["kvfork serve: error: --model: GGUF architecture 'mamba' is not one kvfork serves "
                     "(it serves llama, qwen2, qwen3, gemma3)"]


async def test_gemma3_with_a_sentencepiece_vocabulary_serves(tmp_path):
    """Gemma's tokenizer (sentencepiece, BOS prepended, merges rebuilt from the vocabulary by transformers)
    round-trips text, prepends BOS once, keeps the turn markers whole, and serves a chat over HTTP."""
    from transformers import AutoTokenizer

    gguf = write_gguf(write_model(tmp_path / "hf", "gemma3"), tmp_path / "tiny-gemma3.gguf", Q.Q8_0,
                      tokenizer="sentencepiece")
    model = str(resolve_model(str(gguf)))
    tok = AutoTokenizer.from_pretrained(model)
    text = "the capital of France is Paris, a city on a river!"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 2 and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert "\u2581capital" in tok.convert_ids_to_tokens(ids)  # a whole piece, not letters
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(rendered, add_special_tokens=False)
    assert prompt_ids[:2] == [2, tok.convert_tokens_to_ids("<start_of_turn>")] and prompt_ids.count(2) == 1
    # <eos>, and the turn's end
    assert read_model_facts(model).eos_token_ids == (1, tok.convert_tokens_to_ids("<end_of_turn>"))
    async with serving(model, create_backend("torch")) as daemon, aiohttp.ClientSession() as http:
        async with http.post(f"{daemon.url}/v1/chat/completions", json=chat_body(max_tokens=6)) as r:
            body = await r.json()
    assert r.status == 200 and body["usage"]["prompt_tokens"] > 10, body
