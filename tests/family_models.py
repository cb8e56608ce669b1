"""Tiny model folders whose chat templates teach each tool-call family's markup (our own templates,
written from what the published ones do: tools listed in the system turn, past calls and their results
rendered in the family's markup, past reasoning in its thinking markers).

Turns are ChatML (`<|im_start|>role ... <|im_end|>`) so the scripted backend finds the turn being
written; gpt-oss's are Harmony's own (`<|start|>role<|channel|>...<|message|>...<|end|>`). Each
family's markup tokens are special tokens of its tokenizer, as in the real ones, so the detokenizer
must keep them for the parsers to see them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tiny_models import build_tokenizer


@dataclass(frozen=True)
class Family:
    name: str  # kvfork's parser
    reference: str | None  # mlx-lm's parser module (what mlx-lm's detection says), None where it has none
    call: str  # one Jinja call of `fn` (name, arguments as a mapping) in the family's markup
    wrap: tuple[str, str] = ("", "")  # around all of a turn's calls
    joiner: str = ""  # between calls
    thinking: tuple[str, str] = ("<think>", "</think>")
    specials: tuple[str, ...] = ()

    def call_text(self, name: str, arguments: dict, index: int = 0) -> str:
        """The markup the model writes for one call (the template's rendering of it)."""
        from jinja2 import Environment

        env = Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)  # as transformers does
        env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
        fn = {"name": name, "arguments": arguments}
        return env.from_string(self.call).render(fn=fn, call={"id": f"functions.{name}:{index}", "function": fn},
                                                 loop={"index": index + 1})


def _value(v: str = "v") -> str:
    return "{{ " + v + " if " + v + " is string else " + v + " | tojson }}"


ARGS = "{% for k, v in fn.arguments.items() %}"
NL = "{{ '\\n' }}"  # a newline just after a block tag, which HF's trim_blocks would drop
FAMILIES = {f.name: f for f in (
    Family("glm47", "glm47", "<tool_call>{{ fn.name }}" + ARGS + NL + "<arg_key>{{ k }}</arg_key>\n<arg_value>"
           + _value() + "</arg_value>{% endfor %}" + NL + "</tool_call>", joiner="\n",
           specials=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                     "<think>", "</think>")),
    Family("qwen3_coder", "qwen3_coder", "<tool_call>\n<function={{ fn.name }}>\n" + ARGS + "<parameter={{ k }}>\n"
           + _value() + "\n</parameter>\n{% endfor %}</function>\n</tool_call>", joiner="\n"),
    Family("kimi_k2", "kimi_k2", "<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>"
           "{{ fn.arguments | tojson }}<|tool_call_end|>",
           wrap=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
           specials=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                     "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>")),
    Family("kimi_k3", "kimi_k3", '<|open|>call tool="{{ fn.name }}" index="{{ loop.index }}"<|sep|>'
           '<|open|>json type="object"<|sep|>{{ fn.arguments | tojson }}<|close|>json<|sep|><|close|>call<|sep|>',
           wrap=("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"),
           thinking=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
           specials=("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")),
    Family("minimax_m2", "minimax_m2", '<invoke name="{{ fn.name }}">' + ARGS + NL + '<parameter name="{{ k }}">'
           + _value() + "</parameter>{% endfor %}" + NL + "</invoke>\n",
           wrap=("<minimax:tool_call>\n", "</minimax:tool_call>"),
           specials=("<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>")),
    Family("mistral", "mistral", "[TOOL_CALLS]{{ fn.name }}[ARGS]{{ fn.arguments | tojson }}",
           thinking=("[THINK]", "[/THINK]"), specials=("[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]")),
    Family("gemma4", "gemma4", "<|tool_call>call:{{ fn.name }}{{ '{' }}" + ARGS
           + "{{ k }}:{% if v is string %}<|\"|>{{ v }}"
           "<|\"|>{% else %}{{ v | tojson }}{% endif %}{{ ',' if not loop.last }}{% endfor %}{{ '}' }}<tool_call|>",
           thinking=("<|channel>thought", "<channel|>"),
           specials=("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>")),
    Family("function_gemma", "function_gemma", "<start_function_call>call:{{ fn.name }}{{ '{' }}" + ARGS
           + "{{ k }}:{% if v is string %}<escape>{{ v }}<escape>{% else %}{{ v | tojson }}{% endif %}"
           "{{ ',' if not loop.last }}{% endfor %}{{ '}' }}<end_function_call>",
           specials=("<start_function_call>", "<end_function_call>", "<escape>")),
    Family("pythonic", "pythonic", "<|tool_call_start|>[{{ fn.name }}(" + ARGS
           + "{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}{% endfor %})]<|tool_call_end|>",
           specials=("<|tool_call_start|>", "<|tool_call_end|>")),
    Family("longcat", "longcat", "<longcat_tool_call>{{ fn.name }}" + ARGS + NL + "<longcat_arg_key>{{ k }}"
           "</longcat_arg_key>\n<longcat_arg_value>" + _value() + "</longcat_arg_value>{% endfor %}" + NL
           + "</longcat_tool_call>", joiner="\n", thinking=("<longcat_think>", "</longcat_think>")),
    Family("minicpm5", "minicpm5", '<function name="{{ fn.name }}">' + ARGS + '<param name="{{ k }}">' + _value()
           + "</param>{% endfor %}</function>"),
    Family("muse_spark", "muse_spark", '<atem:invoke name="{{ fn.name }}">' + ARGS + '<atem:parameter name="{{ k }}">'
           + _value() + "</atem:parameter>{% endfor %}</atem:invoke>",
           wrap=("<atem:function_calls>", "</atem:function_calls>")),
)}

CHATML = """\
{%- if tools -%}
{{- '<|im_start|>system\\nTools:' -}}{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor -%}
{{- '\\nCall them as: ' + @EXAMPLE@ + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if message.reasoning_content -%}
{{- @OPEN@ + '\\n' + message.reasoning_content + '\\n' + @CLOSE@ + '\\n\\n' -}}
{%- endif -%}
{{- message.content or '' -}}
{%- if message.tool_calls -%}
{{- ('\\n' if message.content else '') + @WRAP_OPEN@ -}}
{%- for call in message.tool_calls -%}{%- set fn = call.function -%}@CALL@{{ @JOINER@ if not loop.last }}{%- endfor -%}
{{- @WRAP_CLOSE@ -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}
"""

# gpt-oss: Harmony turns; past reasoning read as `thinking`, as gpt-oss's does, and kept (the published template
# drops it once a final answer follows).
HARMONY = """\
{{- '<|start|>system<|message|>Reasoning: medium<|end|>' -}}
{%- if tools -%}
{{- '<|start|>developer<|message|># Tools\\nnamespace functions {' -}}
{%- for tool in tools %}{{ '\\n' + (tool.function | tojson) }}{% endfor -%}
{{- '\\n}<|end|>' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{%- if message.thinking -%}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' -}}
{%- endif -%}
{%- if message.content -%}
{{- '<|start|>assistant<|channel|>' + ('commentary' if message.tool_calls else 'final') + '<|message|>'
    + message.content + '<|end|>' -}}
{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{{- '<|start|>assistant to=functions.' + call.function.name + '<|channel|>commentary json<|message|>'
    + (call.function.arguments | tojson) + '<|call|>' -}}
{%- endfor -%}
{%- elif message.role == 'tool' -%}
{{- '<|start|>functions.' + (message.name or 'tool') + ' to=assistant<|channel|>commentary<|message|>'
    + (message.content | tojson) + '<|end|>' -}}
{%- else -%}
{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif -%}
"""
HARMONY_SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")


def family_template(family: Family) -> str:
    example = family.wrap[0] + family.call_text("NAME", {"KEY": "VALUE"}) + family.wrap[1]
    out = CHATML.replace("@CALL@", family.call)
    for name, value in (("EXAMPLE", example), ("OPEN", family.thinking[0]), ("CLOSE", family.thinking[1]),
                        ("WRAP_OPEN", family.wrap[0]), ("WRAP_CLOSE", family.wrap[1]), ("JOINER", family.joiner)):
        out = out.replace(f"@{name}@", json.dumps(value))
    return out


def write_family_model(source: str | Path, folder: str | Path, template: str, specials: tuple[str, ...]) -> Path:
    """A copy of the tiny model folder `source` with `template` and a tokenizer holding `specials`."""
    folder = Path(folder)
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    build_tokenizer(config["vocab_size"], specials).save(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = template
    config_path.write_text(json.dumps(tok_config, indent=2))
    return folder


def model_for(name: str, source: str | Path, folder: str | Path) -> Path:
    if name == "harmony":
        return write_family_model(source, folder, HARMONY, HARMONY_SPECIALS)
    family = FAMILIES[name]
    return write_family_model(source, folder, family_template(family), family.specials)
