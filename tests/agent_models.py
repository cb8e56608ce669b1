"""Tiny model folders whose chat template teaches tools and thinking (our own template).

The template follows the Hermes/Qwen layout (tools listed in the system turn,
calls as `<tool_call>` JSON, results as `<tool_response>` in a user turn, past
reasoning as a `<think>` block), so the daemon picks the Hermes parser and the
reasoning split from it. `enable_thinking` false closes an empty think block in
the generation prompt (as Qwen3's template does); true opens one (as templates
that always think do), so the reply starts inside it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

AGENT_TEMPLATE = """\
{%- set first = messages[0] if messages else none -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if first and first.role == 'system' %}{{ first.content + '\\n\\n' }}{% endif -%}
{{- 'Functions you may call:\\n<tools>' -}}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor -%}
{{- '\\n</tools>\\nCall one as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n' -}}
{%- elif first and first.role == 'system' -%}
{{- '<|im_start|>system\\n' + first.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if message.reasoning_content %}{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{% endif -%}
{{- message.content or '' -}}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function -%}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
{{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}
{%- elif message.role != 'system' or not loop.first -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif -%}
{%- if enable_thinking is defined and enable_thinking is true %}{{ '<think>\\n' }}{% endif -%}
{%- endif -%}
"""


def with_agent_template(source: str | Path, folder: str | Path) -> Path:
    """A copy of the tiny model folder `source` whose chat template is AGENT_TEMPLATE."""
    folder = Path(folder)
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = AGENT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return folder
