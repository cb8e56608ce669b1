"""Constrained decoding: grammars compiled from what a request asks, masks applied in the batched
sample, off the critical path, and a dead grammar failing its own request only."""

from __future__ import annotations

import asyncio
import json
import os

import jsonschema
import numpy as np
import pytest
from backend_fixtures import backend_name  # noqa: F401  (fixture: each importable backend)
from engine_harness import collect, prompt_of, request, run, start_engine
from scripted_backend import ScriptedBackend

from kvfork.backends import create_backend
from kvfork.backends.base import SamplingParams
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.generate.grammar import GrammarCompiler, GrammarError, JsonObject, JsonSchema, ToolCalls
from kvfork.server.toolcalls import PARSERS
from kvfork.server.watch.metrics import Registry

# ---- a grammar the engine tests can steer: a fixed set of tokens, until it dies ----


def set_bits(out: np.ndarray, tokens) -> None:
    words = out.view(np.uint32)
    for t in tokens:
        words[t // 32] |= np.uint32(1 << (t % 32))


class SetMatcher:
    def __init__(self, allowed: frozenset[int], dies_after: int | None):
        self.allowed, self.dies_after, self.seen = allowed, dies_after, 0

    def advance(self, token: int) -> None:
        assert token in self.allowed, "the backend sampled a token the mask forbids"
        self.seen += 1

    def fill_mask(self, out: np.ndarray) -> str | None:
        out[:] = 0
        if self.dies_after is not None and self.seen >= self.dies_after:
            return "no token fits the grammar here"
        set_bits(out, self.allowed)
        return None

    def fork(self) -> "SetMatcher":
        copy = SetMatcher(self.allowed, self.dies_after)
        copy.seen = self.seen
        return copy


class SetConstraint:
    def __init__(self, allowed, dies_after: int | None = None):
        self.allowed, self.dies_after = frozenset(allowed), dies_after

    def matcher(self) -> SetMatcher:
        return SetMatcher(self.allowed, self.dies_after)


ALLOWED = {7, 31, 32, 300, 511}  # 31 and 511: the sign bit of a mask word


async def test_masks_leave_unconstrained_rows_unchanged():
    engine = await start_engine(ScriptedBackend(), prefix_cache_entries=0)
    prompts = [prompt_of(20, start=10 * i) for i in range(8)]
    alone = [await run(engine, p, 12, rid=f"a{i}") for i, p in enumerate(prompts[:4])]
    mixed = await asyncio.gather(*(run(engine, p, 12, rid=f"u{i}") for i, p in enumerate(prompts[:4])),
                                 *(run(engine, p, 12, rid=f"c{i}", constraint=SetConstraint(ALLOWED))
                                   for i, p in enumerate(prompts[4:])))
    assert [tokens for tokens, _ in mixed[:4]] == [tokens for tokens, _ in alone]
    for tokens, done in mixed[4:]:
        assert done.finish_reason == "length" and len(tokens) == 12
        assert set(tokens) <= ALLOWED
    await engine.shutdown(1)


async def test_a_grammar_that_allows_nothing_fails_its_request_alone():
    engine = await start_engine(ScriptedBackend(), prefix_cache_entries=0)
    prompts = [prompt_of(16, start=5 * i) for i in range(4)]
    alone = [await run(engine, p, 10, rid=f"a{i}") for i, p in enumerate(prompts[:2])]
    results = await asyncio.gather(
        *(run(engine, p, 10, rid=f"u{i}") for i, p in enumerate(prompts[:2])),
        run(engine, prompts[2], 10, rid="dies", constraint=SetConstraint(ALLOWED, dies_after=3)),
        run(engine, prompts[3], 10, rid="dead", constraint=SetConstraint(ALLOWED, dies_after=0)))
    assert [tokens for tokens, _ in results[:2]] == [tokens for tokens, _ in alone]
    assert all(done.finish_reason == "length" for _, done in results[:2])
    for (tokens, done), n in zip(results[2:], (3, 0)):
        assert done.finish_reason == "error" and "grammar" in (done.error or "")
        assert len(tokens) == n and set(tokens) <= ALLOWED
    await engine.shutdown(1)
    assert engine.backend.live_sessions() == 0


# ---- grammars compiled from requests, on a real tokenizer ----

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                           "required": ["q"]}}
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, FR\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
}


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    return hf, GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=5.0, child_env=os.environ)


def accepts(compiler, ask, text: str) -> bool:
    """Whether the grammar lets the model write `text` then end, token by token through the masks."""
    hf, grammars = compiler
    matcher = asyncio.run(grammars.compile(ask)).matcher()
    mask = np.zeros((grammars.vocab_size + 31) // 32, dtype=np.int32)
    for token in hf.encode(text, add_special_tokens=False) + [hf.eos_token_id]:
        if matcher.fill_mask(mask) is not None or not np.unpackbits(mask.view(np.uint8), bitorder="little")[token]:
            return False
        matcher.advance(token)
    return True


def test_json_object_and_schema(compiler):
    assert accepts(compiler, JsonObject(), '{"a": [1, 2], "b": {"c": null}}')
    assert not accepts(compiler, JsonObject(), "[1]")
    schema = WEATHER["parameters"]
    assert accepts(compiler, JsonSchema(schema, strict=True), '{"city": "Paris", "days": 3}')
    assert not accepts(compiler, JsonSchema(schema, strict=True), '{"days": 3}')
    assert not accepts(compiler, JsonSchema(schema, strict=True), '{"city": "Paris", "days": 3.5}')
    # an object schema that leaves additionalProperties unsaid is closed; one that allows them keeps them
    assert not accepts(compiler, JsonSchema(schema), '{"city": "Paris", "mood": "sunny"}')
    assert accepts(compiler, JsonSchema({**schema, "additionalProperties": True}), '{"city": "Paris", "mood": "sunny"}')


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_tool_calls_in_each_parsers_markup(compiler, parser):
    call, tools = CALLS[parser], (WEATHER, SEARCH)
    separator = "; " if parser == "llama3" else "\n"
    forced = PARSERS[parser](None).opening("get_weather")
    assert call.startswith(forced)
    # named: exactly that tool, from the start or after the opening the prompt already holds
    assert accepts(compiler, ToolCalls(parser, tools, "function", "get_weather"), call)
    assert accepts(compiler, ToolCalls(parser, tools, "function", "get_weather", forced), call[len(forced):])
    assert not accepts(compiler, ToolCalls(parser, tools, "function", "search"), call)
    assert not accepts(compiler, ToolCalls(parser, tools, "function", "get_weather"), call + separator + call)
    # required: one call or more, and no prose
    assert accepts(compiler, ToolCalls(parser, tools, "required"), call + separator + call)
    assert not accepts(compiler, ToolCalls(parser, tools, "required"), "hello")
    assert accepts(compiler, ToolCalls(parser, tools, "required", parallel=False), call)
    assert not accepts(compiler, ToolCalls(parser, tools, "required", parallel=False), call + separator + call)
    # auto: prose is free; a call, once opened, must be valid (the parsers read every accepted call back)
    assert accepts(compiler, ToolCalls(parser, tools, "auto"), "hello there")
    assert [e.name for e in _events(parser, call) if hasattr(e, "name")] == ["get_weather"]
    if parser != "llama3":
        assert accepts(compiler, ToolCalls(parser, tools, "auto"), "Let me look.\n" + call + "\nDone.")
        broken = call.replace("get_weather", "get_wether")
        assert not accepts(compiler, ToolCalls(parser, tools, "auto"), "Let me look.\n" + broken)


def _events(parser: str, text: str):
    p = PARSERS[parser]([{"type": "function", "function": WEATHER}])
    return p.feed(text) + p.finish()


def test_bad_schemas_name_the_problem(compiler):
    _, grammars = compiler
    with pytest.raises(GrammarError) as bad_type:
        asyncio.run(grammars.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "frob"}}}, True)))
    assert bad_type.value.status == 400 and "frob" in bad_type.value.message
    assert bad_type.value.param == "response_format"
    with pytest.raises(GrammarError) as bad_ref:
        asyncio.run(grammars.compile(ToolCalls("hermes", ({"name": "f", "parameters": {"$ref": "#/nowhere"}},),
                                               "required")))
    assert "nowhere" in bad_ref.value.message and bad_ref.value.param == "tool_choice"


def test_a_slow_compile_is_a_400(compiler):
    """Past the size where a build is bounded by its size (GUARDED_TEXT), a grammar compiles under the timeout."""
    hf, _ = compiler
    impatient = GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=1e-6, child_env=os.environ)
    wide = {"type": "object", "properties": {f"property_{i}": {"type": "integer"} for i in range(400)}}
    try:
        with pytest.raises(GrammarError) as slow:
            asyncio.run(impatient.compile(JsonSchema(wide)))
        assert "--grammar-compile-timeout" in slow.value.message
    finally:
        impatient.close()


def test_compiled_grammars_are_cached_and_matchers_independent(compiler):
    _, grammars = compiler
    ask = JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}}})
    first = asyncio.run(grammars.compile(ask))
    assert asyncio.run(grammars.compile(JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}}}))) \
        is first
    a = first.matcher()
    b = a.fork()
    mask_a, mask_b = (np.zeros((grammars.vocab_size + 31) // 32, dtype=np.int32) for _ in range(2))
    hf, _ = compiler
    for token in hf.encode('{"n": 1', add_special_tokens=False):
        a.advance(token)
    a.fill_mask(mask_a)
    b.fill_mask(mask_b)
    assert not np.array_equal(mask_a, mask_b)  # b is still at the start


# ---- a tiny real model under a JSON schema, through the engine, on each backend ----

SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "unit": {"enum": ["c", "f"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["ok", "unit", "n"], "additionalProperties": False}


async def test_tiny_model_output_validates_against_the_schema(backend_name, tiny_model_dir):
    from transformers import AutoTokenizer

    folder = tiny_model_dir("llama")
    engine = Engine(create_backend(backend_name), folder, "float32",
                    EngineConfig(kv_budget_bytes=1 << 30, max_tokens=64), Registry())
    await engine.start()
    hf = AutoTokenizer.from_pretrained(folder)
    grammar = await GrammarCompiler(hf, engine.info.vocab_size, engine.info.eos_token_ids, 5.0, os.environ).compile(
        JsonSchema(SMALL, strict=True))
    prompts = [prompt_of(12, start=i) for i in range(3)]
    handles = [engine.submit(request(p, 64, rid=f"j{i}", constraint=grammar,
                                     sampling=SamplingParams(temperature=1.0, seed=i)))
               for i, p in enumerate(prompts)]
    free = engine.submit(request(prompt_of(12, start=40), 8, rid="free"))
    for handle in handles:
        tokens, done = await collect(handle)
        assert done.finish_reason == "stop", done
        jsonschema.validate(json.loads(hf.decode(tokens)), SMALL)
    _, done = await collect(free)
    assert done.finish_reason == "length"
    await engine.shutdown(1)


# ---- the default model: a named tool choice yields a valid call ----


@pytest.mark.default_model
async def test_named_tool_choice_on_the_default_model():
    from transformers import AutoTokenizer

    from kvfork.backends import default_model

    folder = str(default_model.ensure_default_model())
    engine = Engine(create_backend("torch"), folder, "float32", EngineConfig(kv_budget_bytes=1 << 30), Registry())
    await engine.start()
    hf = AutoTokenizer.from_pretrained(folder)
    text = hf.apply_chat_template([{"role": "user", "content": "What's the weather in Paris for 3 days?"}],
                                  tokenize=False, add_generation_prompt=True)
    forced = PARSERS["hermes"](None).opening("get_weather")
    prompt = hf.encode(text + forced, add_special_tokens=False)
    grammar = await GrammarCompiler(hf, engine.info.vocab_size, engine.info.eos_token_ids, 5.0, os.environ).compile(
        ToolCalls("hermes", (WEATHER, SEARCH), "function", "get_weather", forced))
    tokens, done = await collect(engine.submit(request(prompt, 96, constraint=grammar, sampling=SamplingParams())),
                                 timeout=600)
    assert done.finish_reason == "stop", hf.decode(tokens)
    events = _events("hermes", forced + hf.decode(tokens))
    starts = [e for e in events if type(e).__name__ == "ToolCallStart"]
    args = [e for e in events if type(e).__name__ == "ToolCallArguments"]
    assert [s.name for s in starts] == ["get_weather"]
    jsonschema.validate(json.loads(args[0].text), WEATHER["parameters"])
    await engine.shutdown(1)


async def test_each_choice_follows_the_grammar_with_its_own_matcher():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=0)
    prompt = prompt_of(20, start=3)
    alone, _ = await run(engine, prompt, 8, rid="alone", constraint=SetConstraint(ALLOWED))
    handles = engine.submit_choices(request(prompt, 8, n=3, constraint=SetConstraint(ALLOWED)))
    results = await asyncio.gather(*(collect(h) for h in handles))
    # scripted sampling is greedy: every choice is the lone constrained answer, each matcher advanced once per token
    assert [tokens for tokens, _ in results] == [alone] * 3 and set(alone) <= ALLOWED
    assert all(done.finish_reason == "length" for _, done in results)
    dying = engine.submit_choices(request(prompt, 8, n=2, constraint=SetConstraint(ALLOWED, dies_after=3)))
    for tokens, done in await asyncio.gather(*(collect(h) for h in dying)):
        assert done.finish_reason == "error" and tokens == alone[:3]  # each choice's matcher dies on its own
    await engine.shutdown(1)
    assert backend.live_sessions() == 0
