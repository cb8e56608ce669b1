"""What a client may pass a chat template: its own variables, never the template itself.

`chat_template_kwargs` reach the template as variables (vLLM's name and meaning), so a client can
turn a template's switch such as `enable_thinking`. They also reach transformers'
`apply_chat_template(**kwargs)`, where `chat_template` would replace the model's template with the
client's (a loop of 20,000 x 20,000 froze a daemon) and `tokenize` or `return_*` change what comes
back. So, as vLLM does since GHSA-6fvq-23cw-5628:
- a key the template never reads is dropped (a client that sends `enable_thinking` to every model
  keeps working);
- a key that would change the call rather than fill a variable is refused with a 400: the
  parameters of `apply_chat_template` (`chat_template`, `tokenize`, `return_*` ...), the special
  tokens the template is given (`bos_token` ...), and any name the template calls (a function such
  as `raise_exception` or `strftime_now`);
- values are JSON scalars, strings of at most --max-template-kwarg-chars.
An operator sets a template with `--chat-template FILE`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols

from kvfork.server.guard.errors import invalid
from kvfork.server.guard.limits import over

# What the renderer itself sets, whatever the template reads.
RENDERER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})


class _Generation(Extension):
    """transformers' `{% generation %}` block (it marks assistant tokens); parsed here only to be read."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


_ENV = jinja2.Environment(extensions=[_Generation, loopcontrols])


def check_template(source: str) -> str | None:
    """Why a chat template does not parse, or None (for --chat-template, before anything loads)."""
    try:
        _ENV.parse(source)
    except jinja2.TemplateSyntaxError as e:
        return f"the template does not parse: {e.message} (line {e.lineno})"
    return None


def _call_parameters() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    names = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(n for n, p in names.items() if p.kind is not p.VAR_KEYWORD and n != "self")


@dataclass(frozen=True)
class TemplateVariables:
    """The variables of a model's chat template(s): which a request may set, which it may never."""

    settable: frozenset[str]
    refused: frozenset[str]  # besides `return_*`: the call's parameters, special tokens, called names

    @classmethod
    def of(cls, templates: str | dict[str, str] | None, special_tokens: frozenset[str] = frozenset()
           ) -> "TemplateVariables":
        """Raises jinja2.TemplateSyntaxError on a template that does not parse."""
        sources = templates.values() if isinstance(templates, dict) else [templates or ""]
        read, called = set(), set()
        for source in sources:
            tree = _ENV.parse(source)
            read |= jinja2.meta.find_undeclared_variables(tree)
            called |= {call.node.name for call in tree.find_all(nodes.Call) if isinstance(call.node, nodes.Name)}
        refused = _call_parameters() | special_tokens | RENDERER_VARIABLES | called
        return cls(frozenset(read - refused), frozenset(refused))

    def kwargs(self, given: dict[str, Any] | None, max_chars: int) -> dict[str, Any]:
        """The template variables `given` sets; a 400 naming a key that would change the call, or a value
        that is not a short JSON scalar."""
        out: dict[str, Any] = {}
        for key, value in (given or {}).items():
            param = f"chat_template_kwargs.{key}"
            if key in self.refused or key.startswith("return_"):
                raise invalid(param, f"chat_template_kwargs cannot set {key!r}: it is not a variable of the chat "
                              "template (a template is set by the operator, with --chat-template)")
            if key not in self.settable:
                continue  # the template never reads it (vLLM drops these too)
            if value is not None and not isinstance(value, (str, int, float, bool)):
                raise invalid(param, f"chat_template_kwargs values are strings, numbers, booleans or null; "
                              f"{key!r} is {type(value).__name__}")
            if isinstance(value, str) and len(value) > max_chars:
                raise over(param, f"{param} is {len(value):,} characters long", max_chars,
                           "--max-template-kwarg-chars", "string_above_max_length")
            out[key] = value
        return out
