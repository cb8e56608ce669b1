"""Tool-call parsers on scripted model output, whole and split at every boundary."""

from __future__ import annotations

import json

import pytest

from kvfork.server.generate.chat_output import ToolCall
from kvfork.server.toolcalls import PARSERS, detect_tool_parser, resolve_tool_parser
from kvfork.server.toolcalls.base import TextDelta, ToolCallArguments, ToolCallStart
from streaming_helpers import collect, counting_ids, parse_every_way, run

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "lines": {"type": "integer"},
                    "append": {"type": "boolean"},
                    "ratio": {"type": ["number", "null"]},
                    "tags": {"type": "array"},
                    "meta": {"type": "object"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}},
]


def parser(name: str):
    return lambda: PARSERS[name](TOOLS, counting_ids())


def call(index: int, name: str, arguments: dict) -> ToolCall:
    return ToolCall(f"call_{index}", name, json.dumps(arguments, ensure_ascii=False))


# --- Hermes ---------------------------------------------------------------------------------------


def test_hermes_content_then_two_calls():
    text = (
        "Let me check both.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich <b>"}}\n</tool_call>'
    )
    out = parse_every_way(parser("hermes"), text)
    assert out.content == "Let me check both."
    assert out.tool_calls == [call(0, "get_weather", {"city": "Paris"}), call(1, "get_weather", {"city": "Zürich <b>"})]


def test_hermes_streams_start_before_arguments_and_never_leaks_markup():
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    events = run(parser("hermes"), list(text))
    texts = [e.text for e in events if isinstance(e, TextDelta)]
    assert "".join(texts) == "Hi"
    calls = [e for e in events if not isinstance(e, TextDelta)]
    assert calls == [ToolCallStart(0, "call_0", "get_weather"), ToolCallArguments(0, '{"city": "Oslo"}')]


def test_hermes_releases_a_call_as_soon_as_it_closes():
    p = PARSERS["hermes"](TOOLS, counting_ids())
    assert p.feed('<tool_call>{"name": "get_weather", "arguments": {}}') == []
    assert p.feed("</tool_call>") == [ToolCallStart(0, "call_0", "get_weather"), ToolCallArguments(0, "{}")]


def test_hermes_arguments_as_json_string_and_parameters_key():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    assert parse_every_way(parser("hermes"), text).tool_calls == [call(0, "get_weather", {"city": "Rome"})]
    text = '<tool_call>{"name": "get_weather", "parameters": {"city": "Rome"}}</tool_call>'
    assert parse_every_way(parser("hermes"), text).tool_calls == [call(0, "get_weather", {"city": "Rome"})]


def test_hermes_list_of_calls_in_one_element():
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather"}]</tool_call>'
    out = parse_every_way(parser("hermes"), text)
    assert out.tool_calls == [call(0, "get_weather", {"city": "A"}), call(1, "get_weather", {})]


@pytest.mark.parametrize(
    "body",
    [
        '[{"name": "get_weather"}, {"nom": "x"}]',  # a list with a non-call in it
        "[]",
        '{"name": "get_weather", "arguments": {"city": "Paris"}',  # broken JSON
        '{"arguments": {"city": "Paris"}}',  # no name
        '{"name": "get_weather", "arguments": [1, 2]}',  # arguments not an object
        "call get_weather(Paris)",
    ],
)
def test_hermes_malformed_call_falls_back_to_text(body):
    text = f"Sure. <tool_call>{body}</tool_call> done"
    out = parse_every_way(parser("hermes"), text)
    assert out.tool_calls == []
    assert out.content == text


def test_hermes_unclosed_call_at_end():
    complete = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
    assert parse_every_way(parser("hermes"), complete).tool_calls == [call(0, "get_weather", {"city": "Lima"})]
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    out = parse_every_way(parser("hermes"), cut)
    assert (out.content, out.tool_calls) == (cut, [])


def test_plain_text_passes_through_untouched():
    text = "a < b and <tool is not a call\n\n"
    for name in PARSERS:
        out = parse_every_way(parser(name), text)
        assert (out.content, out.tool_calls) == (text, [])


def test_whitespace_only_between_content_and_calls_is_dropped():
    text = 'Before\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n\nAfter  \n'
    out = parse_every_way(parser("hermes"), text)
    assert out.content == "BeforeAfter  \n"
    assert len(out.tool_calls) == 1


# --- Qwen3-Coder ----------------------------------------------------------------------------------

CODER_CALL = (
    "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
    "<parameter=lines>\n12\n</parameter>\n<parameter=append>\nTrue\n</parameter>\n"
    "<parameter=ratio>\nnull\n</parameter>\n<parameter=tags>\n[\"x\", 1]\n</parameter>\n"
    '<parameter=meta>\n{"k": "v"}\n</parameter>\n'
    "<parameter=body>\ndef f():\n    return '<tag>'\n\n</parameter>\n</function>\n</tool_call>"
)
CODER_ARGS = {
    "path": "src/a.py", "lines": 12, "append": True, "ratio": None, "tags": ["x", 1], "meta": {"k": "v"},
    "body": "def f():\n    return '<tag>'\n",
}


def test_qwen3_coder_converts_values_by_schema():
    out = parse_every_way(parser("qwen3_coder"), "I'll write it.\n" + CODER_CALL)
    assert out.content == "I'll write it."
    assert out.tool_calls == [call(0, "write_file", CODER_ARGS)]


def test_qwen3_coder_value_that_does_not_fit_schema_stays_text():
    text = "<tool_call>\n<function=write_file>\n<parameter=lines>\nmany\n</parameter>\n</function>\n</tool_call>"
    assert parse_every_way(parser("qwen3_coder"), text).tool_calls == [call(0, "write_file", {"lines": "many"})]


def test_qwen3_coder_bare_function_and_unknown_tool():
    text = "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>"
    # no schema for `city`: the value stays text
    assert parse_every_way(parser("qwen3_coder"), text).tool_calls == [call(0, "get_weather", {"city": "42"})]
    text = "<tool_call>\n<function=other>\n</function>\n</tool_call>"
    assert parse_every_way(parser("qwen3_coder"), text).tool_calls == [call(0, "other", {})]


def test_qwen3_coder_two_calls_and_missing_parameter_close():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=unit>\nC\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
    )
    out = parse_every_way(parser("qwen3_coder"), text)
    assert out.tool_calls == [call(0, "get_weather", {"city": "Paris", "unit": "C"}), call(1, "get_weather", {})]


@pytest.mark.parametrize(
    "body",
    [
        "\nget_weather(city=Paris)\n",  # not XML
        "\n<function=get_weather>\nstray text\n<parameter=city>\nParis\n</parameter>\n</function>\n",
        "\n<function=>\n</function>\n",
    ],
)
def test_qwen3_coder_malformed_falls_back(body):
    text = f"<tool_call>{body}</tool_call>"
    out = parse_every_way(parser("qwen3_coder"), text)
    assert (out.content, out.tool_calls) == (text, [])


# --- Llama 3 --------------------------------------------------------------------------------------


def test_llama3_single_and_multiple_calls():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_every_way(parser("llama3"), text).tool_calls == [call(0, "get_weather", {"city": "Paris"})]
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "get_weather", "parameters": {}}'
    out = parse_every_way(parser("llama3"), text)
    assert out.content == ""
    assert out.tool_calls == [call(0, "get_weather", {"city": "A"}), call(1, "get_weather", {})]


def test_llama3_releases_each_call_when_complete():
    p = PARSERS["llama3"](TOOLS, counting_ids())
    assert p.feed('  {"name": "get_weather", "parameters": {"city": "X"') == []
    assert p.feed("}}") == [ToolCallStart(0, "call_0", "get_weather"), ToolCallArguments(0, '{"city": "X"}')]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is {x}.",  # content that is not a call
        '{"answer": 42}',  # JSON that is not a call
        '{"name": "get_weather", "parameters": {"city": ',  # cut short
        "<|python_tag|>print('hi')",
    ],
)
def test_llama3_non_calls_are_text(text):
    out = parse_every_way(parser("llama3"), text)
    assert (out.content, out.tool_calls) == (text, [])


def test_llama3_junk_after_a_call_is_text():
    text = '{"name": "get_weather", "parameters": {}} and then some words'
    out = parse_every_way(parser("llama3"), text)
    assert out.tool_calls == [call(0, "get_weather", {})]
    assert out.content == "and then some words"


# --- choice of parser -----------------------------------------------------------------------------


def test_parser_is_chosen_from_the_template():
    qwen25 = "<tools>{{ tool | tojson }}</tools> <tool_call>\\n{\"name\": ...}\\n</tool_call>"
    coder = "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>"
    llama = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}'
    assert detect_tool_parser(qwen25) == "hermes"
    assert detect_tool_parser(coder) == "qwen3_coder"
    assert detect_tool_parser(llama) == "llama3"
    assert detect_tool_parser("{{ '<|im_start|>' + message['content'] }}") is None
    assert detect_tool_parser(None) is None
    assert resolve_tool_parser("auto", coder) == "qwen3_coder"
    assert resolve_tool_parser("hermes", coder) == "hermes"
    assert resolve_tool_parser("none", coder) is None


@pytest.mark.parametrize(
    "name, model_text",
    [
        ("hermes", '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
        ("qwen3_coder", "get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"),
        ("llama3", '"get_weather", "parameters": {"city": "Oslo"}}'),
    ],
)
def test_forced_openings_continue_into_a_call(name, model_text):
    """`required` appends the parser's opening to the prompt; the model's text continues the call.

    A named opening holds the name already: the model goes on from there.
    """
    full = PARSERS[name](TOOLS).opening(None) + model_text
    for forced in (None, "get_weather"):
        p = PARSERS[name](TOOLS, counting_ids())
        opening = p.opening(forced)
        assert full.startswith(opening)
        assert p.feed(opening) == []
        events = p.feed(full[len(opening):]) + p.finish()
        assert events == [ToolCallStart(0, "call_0", "get_weather"), ToolCallArguments(0, '{"city": "Oslo"}')]


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "llama3"])
def test_whitespace_the_model_writes_streams_with_a_bounded_hold_back(name):
    """Issue 23: with tools offered, whitespace was held back without limit in case a call followed:
    a reply of 30 newlines reached the client all at once at the end (and Claude Code timed out)."""
    from kvfork.server.toolcalls.base import MAX_HELD_WS

    p = PARSERS[name](TOOLS, counting_ids())
    if name == "llama3":
        p.feed("Sure.")  # a llama3 reply that does not open with a call is text from then on
    released = []
    for i in range(30):
        released.append("".join(e.text for e in p.feed("\n") if isinstance(e, TextDelta)))
    assert all(released[MAX_HELD_WS:])  # every token past the hold-back comes out as it arrives
    assert sum(map(len, released)) == 30 - MAX_HELD_WS


# --- hostile model text (issue 45) ------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": ' + DEEP + "}</tool_call>"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "' + DEEP + '"}</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"a": ' + DEEP + "}}"),
])
def test_deeply_nested_json_in_a_call_is_text(name, text):
    """JSON nested past what Python's reader recurses into: the model's text, as broken markup is."""
    out = collect(run(parser(name), [text]))  # whole: a split at each of its 200,000 boundaries is too many
    assert out.tool_calls == [] and out.content == text


def test_llama3_decodes_a_call_once_however_many_deltas_close_a_brace(monkeypatch):
    """Deltas that each close a brace inside a call's arguments: the parser decodes the call's JSON once, when
    it closes, never its pending text again on every delta (quadratic: 64,000 such deltas cost 33 s)."""
    decoded = []
    raw_decode = json.JSONDecoder.raw_decode
    monkeypatch.setattr(json.JSONDecoder, "raw_decode",
                        lambda self, s, idx=0: decoded.append(len(s) - idx) or raw_decode(self, s, idx))
    p = PARSERS["llama3"](TOOLS, counting_ids())
    pieces = ['{"name": "get_weather", "parameters": {"k": [', *["{}, "] * 4_000, "{}]}}"]
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    text = "".join(pieces)
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments]
    assert sum(decoded) <= 2 * len(text)
