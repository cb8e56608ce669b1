"""GLM-4.5 / 4.6 / 4.7 calls (and LongCat's, the same layout under its own tags), read by mlx-lm's glm47
and longcat parsers:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A value is text when the tool's schema says string, JSON otherwise (the
reference parser converts by the schema). GLM-4.7 drops the newlines; the
parser reads both, and constrained calls are written in 4.5's layout.
Poolside's Laguna writes GLM's markup: `--tool-parser laguna` is this family.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvfork.server.toolcalls.grammar_pieces import CallGrammar, in_order, parameter_rules
from kvfork.server.toolcalls.mlx_lm_parsers import MlxLmParser


class GlmParser(MlxLmParser):
    name = "glm47"
    aliases = ("glm45", "laguna")
    reference = "glm47"
    tag = ""  # LongCat prefixes every tag with `longcat_`
    markers = (("<tool_call>", "</tool_call>"),)
    special_markers = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def opening(self, name: str | None) -> str:
        return f"<{self.tag}tool_call>" + (name or "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        """The name, then one key/value pair per property in the schema's order (required ones always)."""
        t = cls.tag
        parts, rules = parameter_rules(function, index, lambda key: f"\n<{t}arg_key>{key}</{t}arg_key>\n<{t}arg_value>",
                                       f"</{t}arg_value>", specials)
        return CallGrammar(f"<{t}tool_call>{function['name']}", in_order(parts), f"\n</{t}tool_call>", rules)


class LongcatParser(GlmParser):
    name = "longcat"
    aliases = ()
    reference = "longcat"
    tag = "longcat_"
    markers = (("<longcat_tool_call>", "</longcat_tool_call>"),)
    special_markers = ("<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>", "</longcat_arg_key>",
                       "<longcat_arg_value>", "</longcat_arg_value>")
