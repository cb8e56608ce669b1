"""Reasoning split from content, and the whole output pipeline, on scripted text."""

from __future__ import annotations

import json

from kvfork.server.generate.chat_output import ChatOutputParser, ModelFormats, ToolCall
from kvfork.server.generate.reasoning import ReasoningSplitter, detect_reasoning, starts_in_reasoning
from kvfork.server.toolcalls import PARSERS
from kvfork.server.toolcalls.base import ReasoningDelta, TextDelta
from streaming_helpers import counting_ids, parse_every_way, run

QWEN3_TEMPLATE = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %} <tool_call> </tool_call>"
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]


def splitter(in_reasoning: bool = False):
    return lambda: ChatOutputParser(reasoning=ReasoningSplitter(in_reasoning))


def test_think_block_then_content():
    out = parse_every_way(splitter(), "<think>\nThe user greets.\nSo greet back.\n</think>\n\nHello <b>there</b>!")
    assert out.reasoning == "The user greets.\nSo greet back."
    assert out.content == "Hello <b>there</b>!"


def test_output_starting_inside_the_think_block():
    out = parse_every_way(splitter(in_reasoning=True), "\nhmm, 2 < 3.\n</think>\n\nYes.")
    assert (out.reasoning, out.content) == ("hmm, 2 < 3.", "Yes.")


def test_unclosed_think_is_all_reasoning():
    out = parse_every_way(splitter(), "<think>\nstill thinking about </thi")
    assert (out.reasoning, out.content) == ("still thinking about </thi", "")


def test_no_think_block_is_all_content():
    text = "Plain answer with a <thing> and\nnewlines\n"
    out = parse_every_way(splitter(), text)
    assert (out.reasoning, out.content) == ("", text)


def test_empty_think_block_from_a_no_thinking_turn():
    out = parse_every_way(splitter(), "<think>\n\n</think>\n\nDone.")
    assert (out.reasoning, out.content) == ("", "Done.")


def test_reasoning_streams_before_the_block_closes():
    parser = ReasoningSplitter()
    assert parser.feed("<think>\nstep one") == [ReasoningDelta("step one")]
    assert parser.feed("\n") == []  # may be the newline before </think>: held
    assert parser.feed("step two") == [ReasoningDelta("\nstep two")]
    assert parser.feed("</think>\n\nAns") == [TextDelta("Ans")]


def test_prompt_ending_in_open_think_starts_in_reasoning():
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n")
    assert detect_reasoning(QWEN3_TEMPLATE) == "think" and detect_reasoning("{{ messages }}") is None


def test_reasoning_then_tool_call_through_the_pipeline():
    text = (
        '<think>\nI should list files. <tool_call>{"name": "ls"}</tool_call> is how.\n</think>\n\n'
        'Listing.\n<tool_call>\n{"name": "ls", "arguments": {"dir": "."}}\n</tool_call>'
    )

    def make():
        return ModelFormats.resolve("auto", "auto", QWEN3_TEMPLATE).parser("assistant\n", TOOLS, "auto", make_id=counting_ids())

    out = parse_every_way(make, text)
    # a call written inside the reasoning is thought, not made
    assert out.reasoning == 'I should list files. <tool_call>{"name": "ls"}</tool_call> is how.'
    assert out.content == "Listing."
    assert out.tool_calls == [ToolCall("call_0", "ls", json.dumps({"dir": "."}))]


def test_pipeline_choices():
    def parts(settings=("auto", "auto"), template=QWEN3_TEMPLATE, tools=TOOLS, choice="auto"):
        p = ModelFormats.resolve(*settings, template).parser("x", tools, choice)
        return type(p.tool_parser).__name__ if p.tool_parser else None, p.reasoning is not None

    assert parts() == ("HermesParser", True)
    assert parts(tools=None) == (None, True)  # no tools offered: nothing to parse
    assert parts(choice="none") == (None, True)
    assert parts(settings=("llama3", "none")) == ("Llama3Parser", False)
    assert parts(template="{{ messages }}") == (None, False)
    assert parts(template="{{ messages }}", settings=("auto", "think")) == (None, True)


def test_pipeline_without_parsers_passes_text_through():
    events = run(lambda: ChatOutputParser(), ["<think>a</think>", "<tool_call>{}</tool_call>", ""])
    assert events == [TextDelta("<think>a</think>"), TextDelta("<tool_call>{}</tool_call>")]
    assert {"hermes", "qwen3_coder", "llama3", "glm47", "kimi_k2", "harmony", "mistral"} <= set(PARSERS)


def test_required_and_named_choices_force_the_opening():
    def make(choice, name=None, template=QWEN3_TEMPLATE, prompt="assistant\n"):
        return lambda: ModelFormats.resolve("auto", "auto", template).parser(prompt, TOOLS, choice, name, counting_ids())

    assert make("required")().prompt_suffix == "<tool_call>\n"
    out = parse_every_way(make("required"), '{"name": "ls", "arguments": {}}\n</tool_call>')
    assert (out.content, out.tool_calls) == ("", [ToolCall("call_0", "ls", "{}")])

    assert make("function", "ls")().prompt_suffix == '<tool_call>\n{"name": "ls", "arguments": '
    out = parse_every_way(make("function", "ls"), '{"dir": "/"}}\n</tool_call>\nDone.')
    assert (out.content, out.tool_calls) == ("Done.", [ToolCall("call_0", "ls", '{"dir": "/"}')])

    # a botched forced call comes back as text, the forced opening included
    out = parse_every_way(make("function", "ls"), "oops</tool_call>")
    assert out.content == '<tool_call>\n{"name": "ls", "arguments": oops</tool_call>'

    # nothing is forced where the reply starts inside <think>, nor for auto
    assert make("required", prompt="assistant\n<think>\n")().prompt_suffix == ""
    assert make("auto")().prompt_suffix == ""
