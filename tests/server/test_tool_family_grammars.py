"""Each family's constraint and what kvfork relies on in mlx-lm: its parsers' markers, its detection,
and forced calls that mlx-lm's own `parse_tool_call` reads back as schema-valid calls, from random
tokens drawn under the grammar and from the tiny random model over HTTP."""

from __future__ import annotations

import json
import os

import jsonschema
import numpy as np
import openai
import pytest

from backend_fixtures import backend_name  # noqa: F401  (fixture: each importable backend)
from family_models import FAMILIES, model_for
from kvfork.backends import create_backend
from http_daemon import serving
from kvfork.server.generate.chat_output import ModelFormats, start_formats
from kvfork.server.generate.grammar import GrammarCompiler, grammar_text, request_ask
from kvfork.server.generate.reasoning import detect_reasoning
from kvfork.server.text.tokenizer import PromptTokenizer
from kvfork.server.toolcalls import PARSERS, detect_tool_parser
from kvfork.server.toolcalls.mlx_lm_parsers import MlxLmParser, mlx_lm_module
from streaming_helpers import counting_ids, parse_every_way

FORECAST = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                             "kind": {"type": "string", "enum": ["rain", "sun"]}},
            "required": ["unit", "days"]}
ALERTS = {"type": "object", "properties": {"severe": {"type": "boolean"}}, "required": ["severe"]}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}},
         {"type": "function", "function": {"name": "get_alerts", "parameters": ALERTS}}]
SCHEMAS = {"get_forecast": FORECAST, "get_alerts": ALERTS}
NAMES = (*FAMILIES, "harmony")
REFERENCES = sorted({p.reference for p in PARSERS.values() if issubclass(p, MlxLmParser)})


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    from tiny_models import write_model

    base = write_model(tmp_path_factory.mktemp("base"), "llama")
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = str(model_for(name, base, tmp_path_factory.mktemp(name)))
        return made[name]

    return get


@pytest.mark.parametrize("reference", REFERENCES)
def test_the_markers_are_mlx_lms(reference):
    module = mlx_lm_module(reference)
    (family,) = {p for p in PARSERS.values() if getattr(p, "reference", None) == reference}
    assert family.markers[0] == (module.tool_call_start, module.tool_call_end)
    assert callable(module.parse_tool_call)


@pytest.mark.parametrize("name", NAMES)
def test_detection_agrees_with_mlx_lm_and_never_misreads(name, family_dir):
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(family_dir(name))
    vocabulary = {t.content for t in tokenizer.added_tokens_decoder.values()}
    assert detect_tool_parser(tokenizer.chat_template, vocabulary) == name
    if name != "harmony":  # mlx-lm has no Harmony parser
        wrapper = load(Path(family_dir(name)))  # mlx-lm's own detection, as its server loads a model
        assert wrapper.tool_parser.__module__ == f"mlx_lm.tool_parsers.{FAMILIES[name].reference}"
        assert wrapper.tool_call_start == PARSERS[name].markers[0][0]
        thinking = FAMILIES[name].thinking[0]
        expected = {"[THINK]": "mistral", "<|channel>thought": "gemma4", "<longcat_think>": "longcat",
                    "<|open|>think<|sep|>": "kimi_k3"}.get(thinking, "think")
        assert detect_reasoning(tokenizer.chat_template, vocabulary) == expected
    else:
        assert detect_reasoning(tokenizer.chat_template, vocabulary) == "harmony"


def reference_calls(name: str, text: str) -> list[dict]:
    """The calls mlx-lm's own parser reads in `text`, given what its server gives it: the text between the
    family's markers (Harmony and Hermes, which mlx-lm does not read this way, by their JSON bodies)."""
    if name == "harmony":
        header, _, body = text.partition("<|message|>")
        name = header.split("to=functions.")[1].split("<|")[0]
        return [{"name": name, "arguments": json.loads(body.split("<|call|>")[0])}]
    family = PARSERS[name]
    start, end = family.markers[0]
    parse = mlx_lm_module(getattr(family, "reference", name)).parse_tool_call  # qwen3_coder: ours, and mlx-lm's
    calls = []
    for chunk in text.split(start)[1:]:
        body = chunk.split(end)[0] if end else chunk
        parsed = parse(body, TOOLS)
        calls += parsed if isinstance(parsed, list) else [parsed]
    return calls


def draw(grammar, vocab_size: int, rng: np.random.Generator, limit: int = 400) -> list[int]:
    """Random tokens the grammar allows, until it allows only the end (or allows it, half the time)."""
    matcher, mask, out = grammar.matcher(), np.zeros((vocab_size + 31) // 32, dtype=np.int32), []
    for _ in range(limit):
        assert matcher.fill_mask(mask) is None
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size])
        ends = allowed == 2
        if ends.any() and (ends.all() or rng.random() < 0.5):
            return out
        token = int(rng.choice(allowed[~ends]))
        matcher.advance(token)
        out.append(token)
    raise AssertionError("the grammar never let the call end")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("choice", ["required", "function"])
async def test_forced_calls_from_random_tokens_are_read_by_mlx_lm(name, choice, family_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(family_dir(name))
    tokenizer = PromptTokenizer(hf)
    formats = ModelFormats.of(tokenizer, "auto", "auto")
    await start_formats(tokenizer, formats, "auto")
    tool_name = "get_forecast" if choice == "function" else None
    def make():
        return formats.parser("", TOOLS, choice, tool_name, counting_ids())

    parser = make()
    assert parser.call_format == name and parser.prompt_suffix
    ask = request_ask(None, name, TOOLS, choice, tool_name, parser.prompt_suffix, parallel=False,
                      specials=tokenizer.specials)
    grammar = GrammarCompiler(hf, len(hf), [2], 10.0, os.environ).build(grammar_text(ask), "tool_choice")
    rng = np.random.default_rng(0)
    for _ in range(3):
        reply = tokenizer.decode_markup(draw(grammar, len(hf), rng))
        text = parser.prompt_suffix + reply
        calls = reference_calls(name, text)
        assert len(calls) == 1 and calls[0]["name"] in (tool_name or "get_forecast get_alerts").split()
        jsonschema.validate(calls[0]["arguments"], SCHEMAS[calls[0]["name"]])
        out = parse_every_way(make, reply)  # kvfork's own parser reads the same call
        assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == \
            [(calls[0]["name"], calls[0]["arguments"])]


@pytest.mark.parametrize("name", NAMES)
async def test_a_named_call_on_the_random_model_over_http(name, family_dir):
    await named_call(name, family_dir, "mlx")


@pytest.mark.parametrize("name", ["glm47", "qwen3_coder", "harmony", "kimi_k2", "minimax_m2", "mistral"])
async def test_a_named_call_on_the_torch_backend(name, family_dir, backend_name):
    if backend_name != "torch":
        pytest.skip("the MLX backend's runs are above")
    await named_call(name, family_dir, "torch")


async def named_call(name: str, family_dir, backend: str) -> None:
    async with (serving(family_dir(name), create_backend(backend), served_model_name=["tiny"]) as d,
                openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0) as client):
        done = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "the forecast"}], tools=TOOLS, max_tokens=256,
            tool_choice={"type": "function", "function": {"name": "get_forecast"}}, temperature=1.0, seed=1)
    (call,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_forecast"
    jsonschema.validate(json.loads(call.function.arguments), FORECAST)
