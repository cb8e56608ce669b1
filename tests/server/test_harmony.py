"""gpt-oss's Harmony channels, each family's thinking markers, and the families' parsing edges, on
scripted text, whole and split at every boundary."""

from __future__ import annotations

import json
import logging

from family_models import HARMONY, model_for
from http_daemon import serving
from kvfork.server.generate.chat_output import ModelFormats
from kvfork.server.generate.reasoning import FORMATS, resolve_reasoning
from kvfork.server.toolcalls import resolve_tool_parser
from streaming_helpers import collect, counting_ids, parse_every_way, run

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def harmony(tools=(WEATHER,), choice="auto", name=None):
    return lambda: ModelFormats.resolve("auto", "auto", HARMONY).parser("<|start|>assistant", list(tools) or None,
                                                                choice, name, counting_ids())


def test_analysis_is_reasoning_and_final_is_content():
    text = ("<|channel|>analysis<|message|>Think < 2 <|end|><|start|>assistant<|channel|>final<|message|>"
            "Hello <b>there</b>!<|return|>")
    out = parse_every_way(harmony(), text)
    assert (out.reasoning, out.content, out.tool_calls) == ("Think < 2 ", "Hello <b>there</b>!", [])


def test_the_model_s_own_call_layout_and_a_preamble():
    """Recipient after the channel, `<|constrain|>json`, the reply ending on the call (`<|call|>` is an
    end-of-sequence token the text may never hold)."""
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Oslo", "days": 2}')
    out = parse_every_way(harmony(), text)
    assert (out.reasoning, out.content) == ("Need weather.", "Checking.")
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Oslo", "days": 2})]


def test_text_that_is_not_harmony_is_content_and_broken_calls_are_text():
    assert parse_every_way(harmony(), "Just text, no channels.").content == "Just text, no channels."
    broken = " to=functions.get_weather<|channel|>commentary json<|message|>{oops<|call|>"
    out = parse_every_way(harmony(), broken)
    assert out.tool_calls == [] and "{oops" in out.content
    unknown = " to=functions.nope<|channel|>commentary json<|message|>{}<|call|>"
    assert parse_every_way(harmony(), unknown).tool_calls == []


def test_without_tools_the_channels_still_split():
    text = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Yes."
    out = parse_every_way(harmony(tools=()), text)
    assert (out.reasoning, out.content) == ("Hm.", "Yes.")


def test_a_forced_call_opens_in_the_template_s_layout():
    parser = harmony(choice="function", name="get_weather")()
    assert parser.prompt_suffix == " to=functions.get_weather<|channel|>commentary json<|message|>"
    out = parse_every_way(harmony(choice="function", name="get_weather"), '{"city": "Rome"}<|call|>')
    assert [json.loads(c.arguments) for c in out.tool_calls] == [{"city": "Rome"}]


def thinking(fmt: str, in_reasoning: bool = False):
    prompt = "x" + (FORMATS[fmt].open if in_reasoning else "")
    return lambda: ModelFormats.resolve("none", fmt, None).parser(prompt, None)


def test_each_thinking_format_splits_and_never_loses_content():
    for fmt in FORMATS.values():
        out = parse_every_way(thinking(fmt.name), f"{fmt.open}\nWhy.\n{fmt.close}\n\nBecause < {fmt.name}.")
        assert (out.reasoning, out.content) == ("Why.", f"Because < {fmt.name}.")
        out = parse_every_way(thinking(fmt.name, in_reasoning=True), f"Why.{fmt.close}Done.")
        assert (out.reasoning, out.content) == ("Why.", "Done.")


def test_setting_names_resolve():
    assert resolve_reasoning("mistral", None) == "mistral" and resolve_reasoning("none", "<think>") is None
    assert resolve_tool_parser("glm45", None) == "glm47" and resolve_tool_parser("laguna", None) == "glm47"
    assert resolve_tool_parser("json_tools", None) == "hermes"


def family_parser(name: str):
    return lambda: ModelFormats.resolve(name, "none", None).parser("", [WEATHER], make_id=counting_ids())


def test_kimi_keeps_the_model_s_call_ids():
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:4'
            '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>')
    out = parse_every_way(family_parser("kimi_k2"), text)
    assert [c.id for c in out.tool_calls] == ["functions.get_weather:3", "functions.get_weather:4"]


def test_mistral_calls_run_to_the_end_of_the_reply():
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"days": 2}'
    out = parse_every_way(family_parser("mistral"), text)
    assert out.content == "Sure." and [json.loads(c.arguments) for c in out.tool_calls] == [{"city": "Paris"},
                                                                                            {"days": 2}]


def test_glm_values_follow_the_schema_and_a_cut_off_call_is_text():
    call = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n" \
           "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    out = parse_every_way(family_parser("glm47"), call)
    assert [json.loads(c.arguments) for c in out.tool_calls] == [{"city": "42", "days": 3}]
    cut = call[:60]
    out = parse_every_way(family_parser("glm47"), cut)
    assert (out.tool_calls, out.content) == ([], cut)


async def test_a_template_with_unknown_tool_markup_serves_and_warns(tiny_model_dir, tmp_path, caplog):
    """Tools rendered in a markup no family reads: served with parsing off, a warning naming --tool-parser."""
    template = ("{% for t in tools or [] %}<<fn {{ t.function.name }}>>{% endfor %}{% for m in messages %}"
                "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    folder = model_for("glm47", tiny_model_dir("llama"), tmp_path / "odd")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    caplog.set_level(logging.WARNING, "kvfork")
    async with serving(str(folder), served_model_name=["tiny"]):
        pass
    assert any("--tool-parser" in r.getMessage() for r in caplog.records)


async def test_markup_tokens_are_kept_for_the_parsers_only(tiny_model_dir, tmp_path):
    """The chat routes' text keeps the model's markup tokens for the parsers; /v1/completions' drops them."""
    from kvfork.server.generate.chat_output import ModelFormats, start_formats
    from kvfork.server.text.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer.load(str(model_for("harmony", tiny_model_dir("llama"), tmp_path / "harmony")))
    assert await start_formats(tokenizer, ModelFormats.of(tokenizer, "auto", "auto"), "auto") is None
    ids = tokenizer.tokenizer.encode("<|channel|>final<|message|>Hi<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode_markup(ids) == "<|channel|>final<|message|>Hi"
    assert tokenizer.decode(ids) == "finalHi"
    tokenizer.close()


def test_a_checkpoint_that_names_its_parser_gets_it():
    """MLX conversions name their parser in tokenizer_config.json (`tool_parser_type`): it wins over the template."""
    assert resolve_tool_parser("auto", "<tool_call>", named="laguna") == "glm47"
    assert resolve_tool_parser("auto", "<tool_call>", named="unheard_of") == "hermes"
    assert resolve_tool_parser("none", "<tool_call>", named="glm47") is None


def test_every_family_and_thinking_format_is_a_flag_value():
    from kvfork.server.cli import serve_parser
    from kvfork.server.common.config import ServerConfig
    from kvfork.server.settings import from_args

    for tool, thinking in [("glm47", "think"), ("harmony", "harmony"), ("kimi_k3", "kimi_k3"), ("mistral", "mistral"),
                           ("minimax_m2", "gemma4"), ("laguna", "longcat")]:
        args = serve_parser().parse_args(["--tool-parser", tool, "--reasoning-parser", thinking])
        config = from_args(ServerConfig, args)
        assert (config.tool_parser, config.reasoning_parser) == (tool, thinking)


def test_arguments_nested_deeper_than_json_reads_are_text():
    """A call whose JSON nests past what Python's reader recurses into is the model's text (issue 45)."""
    body = '{"city": ' + "[" * 100_000 + "]" * 100_000 + "}"
    text = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + body
    out = collect(run(harmony(), [text]))
    assert out.tool_calls == [] and body in out.content
