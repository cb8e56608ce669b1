"""The pieces a family's constraint grammar is written with (llguidance's Lark dialect).

Each family module says how one call to one function is written (`CallGrammar`:
literal head, constrained body, literal tail); server/generate/grammar.py joins the calls
into the grammar a request's tool_choice asks for.

Markup that is a special token of the model's tokenizer (Kimi's
`<|tool_call_begin|>`, Harmony's `<|channel|>`, Mistral's `[TOOL_CALLS]`) is
not text to the tokenizer: a quoted literal could never match it. `markup`
writes such pieces as llguidance's token references `<[id]>`, from the
`specials` (text -> id) the request's tokenizer has.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# JSON as json.dumps and the chat templates' `tojson` write it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SUBSCHEMAS = ("items", "anyOf", "oneOf", "allOf", "not", "prefixItems", "additionalProperties")


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that leaves it unsaid."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in schema[key].items()}
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def schema_json(schema: dict[str, Any], lenient: bool) -> str:
    options = {**JSON_OPTIONS, "lenient": lenient}
    return json.dumps({**closed(schema), "x-guidance": options}, ensure_ascii=False)


def json_value(schema: dict[str, Any], function: dict[str, Any]) -> str:
    """A JSON value valid against `schema` (strict when the function says so)."""
    return "%json " + schema_json(schema, not function.get("strict", False))


def parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def properties(function: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, schema, required) for each parameter, in the schema's order."""
    params = parameters(function)
    required = set(params.get("required") or ())
    return [(key, schema if isinstance(schema, dict) else {}, key in required)
            for key, schema in (params.get("properties") or {}).items()]


def is_text(schema: dict[str, Any]) -> bool:
    """A parameter written as bare text in XML-ish markup (the parsers read its value back as a string)."""
    enum = schema.get("enum")
    return schema.get("type", "string") == "string" and (enum is None or all(isinstance(v, str) for v in enum))


def text_value(rule: str, schema: dict[str, Any], end: str, specials: Mapping[str, int]) -> str:
    """The rule `rule`: a text parameter's value as bare text, then `end`: one of its enum's values, or
    free text up to the first `end`."""
    if isinstance(schema.get("enum"), list):
        values = " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
        return f"{rule}: ({values}) {markup(end, specials)}"
    return text_until(rule, end, specials)


def markup(text: str, specials: Mapping[str, int]) -> str:
    """`text` as a Lark sequence: quoted literals, and token references for the special tokens in it."""
    if not text:
        return ""
    present = sorted((s for s in specials if s in text), key=len, reverse=True)
    if not present:
        return json.dumps(text, ensure_ascii=False)
    parts = re.split("(" + "|".join(re.escape(s) for s in present) + ")", text)
    return " ".join(f"<[{specials[p]}]>" if p in specials else json.dumps(p, ensure_ascii=False)
                    for p in parts if p)


def text_until(rule: str, end: str, specials: Mapping[str, int]) -> str:
    """A rule: free text up to (and including) `end`, the first `end` (lazy) or, when `end` is one special
    token (which text never holds), that token."""
    if end in specials:
        return f"{rule}: ANY_TEXT {markup(end, specials)}"
    return f"{rule}[lazy]: ANY_TEXT {markup(end, specials)}"


@dataclass
class CallGrammar:
    """One call's markup: `head` (literal text), then the body expression, then `tail` (literal).
    `rules` are the Lark rules the body refers to."""

    head: str
    body: str
    tail: str
    rules: list[str] = field(default_factory=list)

    def expression(self, specials: Mapping[str, int], drop: str = "") -> str | None:
        """The call as a Lark sequence, `drop` (text already in the prompt) cut from its start; None if it
        does not start with `drop`."""
        if not self.head.startswith(drop):
            return None
        parts = (markup(self.head[len(drop):], specials), self.body, markup(self.tail, specials))
        return " ".join(part for part in parts if part)


def joined(required: list[str], optional: list[str], separator: str) -> str:
    """Rules in order with `separator` between those present: the required ones always, the optional ones
    after them (with no required one, the first optional one opens the rest)."""
    sep = json.dumps(separator)
    if required:
        return f" {sep} ".join(required) + "".join(f" ({sep} {r})?" for r in optional)
    if optional:
        return f"({optional[0]}" + "".join(f" ({sep} {r})?" for r in optional[1:]) + ")?"
    return ""


def parameter_rules(function: dict[str, Any], index: int, head: Callable[[str], str], close: str,
                    specials: Mapping[str, int], text: tuple[str, str] | None = None,
                    ) -> tuple[list[tuple[str, bool]], list[str]]:
    """One rule per parameter of `function`, in the schema's order: `head(key)`, then the value and `close`.
    A text parameter's value is bare text between `text` (opening, closing; default: nothing, `close`), any
    other is JSON. Returns ([(rule, required)], the rules' definitions)."""
    text_open, text_close = text or ("", close)
    parts, rules = [], []
    for k, (key, schema, required) in enumerate(properties(function)):
        rule = f"p{index}_{k}"
        start = " ".join(p for p in (markup(head(key), specials), markup(text_open, specials)) if p)
        if is_text(schema):
            rules += [text_value(f"{rule}_value", schema, text_close, specials), f"{rule}: {start} {rule}_value"]
        else:
            value = " ".join(p for p in (markup(head(key), specials), json_value(schema, function),
                                         markup(close, specials)) if p)
            rules.append(f"{rule}: {value}")
        parts.append((rule, required))
    return parts, rules


def in_order(parts: list[tuple[str, bool]]) -> str:
    """Parameter rules in the schema's order, the optional ones optional."""
    return " ".join(rule if required else f"{rule}?" for rule, required in parts)
