"""From generated text to what a chat reply holds: reasoning, content, tool calls.

One `ChatOutputParser` per request: text deltas go through the reasoning
splitter, then its content through the tool-call parser. Streaming routes
forward the events; non-streaming routes feed everything and `collect` them,
so both give the same reply.

tool_choice, and how far it is enforced:
- `auto`: the model decides; calls it writes are parsed.
- `none`: tools still reach the template (the prompt stays the one other turns
  share), and nothing is parsed: whatever the model writes is content.
- `required` / a named function: the prompt ends with the family's opening
  markup (`<tool_call>` ..., with the function's name when one is named), so the
  reply starts inside a call to it; the grammar (server/generate/grammar.py) holds the
  rest of the call to the tool's schema.
  A reply that would start inside a thinking block is not forced (forcing
  would cut the reasoning off); the choice then acts as `auto`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from kvfork.server.generate.reasoning import FORMATS, ReasoningSplitter, resolve_reasoning, starts_in_reasoning
from kvfork.server.guard.errors import ApiError
from kvfork.server.toolcalls import PARSERS, resolve_tool_parser
from kvfork.server.toolcalls.harmony import HarmonyParser
from kvfork.server.toolcalls.base import (
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    openai_call_id,
)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ChatOutput:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatOutputParser:
    def __init__(
        self, tool_parser: ToolParser | None = None, reasoning: ReasoningSplitter | None = None, forced: str = ""
    ):
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        self.prompt_suffix = forced  # appended to the prompt; the reply continues from inside it
        if forced:  # the parser reads the forced opening as the start of the reply (it yields nothing yet)
            assert tool_parser is not None
            tool_parser.feed(forced)

    @property
    def call_format(self) -> str | None:
        """The family whose calls are parsed from the reply (None: none are)."""
        parser = self.tool_parser
        return parser.name if parser is not None and parser.parse_calls else None

    def copy(self) -> "ChatOutputParser":
        """Another parser in this one's state (a forced opening already read), for another choice."""
        return copy.deepcopy(self)

    def feed(self, text: str) -> list[Event]:
        return self._tools(self.reasoning.feed(text) if self.reasoning else [TextDelta(text)], final=False)

    def finish(self) -> list[Event]:
        return self._tools(self.reasoning.finish() if self.reasoning else [], final=True)

    def _tools(self, events: list[Event], final: bool) -> list[Event]:
        if not self.tool_parser:
            return [e for e in events if not isinstance(e, TextDelta) or e.text]
        out: list[Event] = []
        for event in events:
            out.extend(self.tool_parser.feed(event.text) if isinstance(event, TextDelta) else [event])
        if final:
            out.extend(self.tool_parser.finish())
        return out


@dataclass(frozen=True)
class ModelFormats:
    """What a model's chat template and vocabulary say of its replies, resolved once when its tokenizer loads:
    the tool-call family its calls are parsed as and the reasoning format its thinking is split by (None:
    none), each as --tool-parser and --reasoning-parser name it or, `auto`, as the template teaches it."""

    tool: str | None
    reasoning: str | None

    @classmethod
    def of(cls, tokenizer: Any, tool_setting: str, reasoning_setting: str) -> "ModelFormats":
        """A PromptTokenizer's formats."""
        return cls.resolve(tool_setting, reasoning_setting, tokenizer.chat_template, tokenizer.vocabulary,
                           tokenizer.tool_parser_type)

    @classmethod
    def resolve(cls, tool_setting: str, reasoning_setting: str, chat_template: str | None,
                vocabulary: Collection[str] = (), named: str | None = None) -> "ModelFormats":
        """The formats the settings mean for a template; `vocabulary` is the tokenizer's added tokens, which say
        some families (Kimi K3) where the template does not; `named` the checkpoint's own `tool_parser_type`."""
        return cls(resolve_tool_parser(tool_setting, chat_template, vocabulary, named),
                   resolve_reasoning(reasoning_setting, chat_template, vocabulary))

    def parser(self, prompt_text: str, tools: list[dict] | None, tool_choice: str = "auto",
               tool_name: str | None = None, make_id: Callable[[], str] = openai_call_id) -> ChatOutputParser:
        """The parser for one request: tools are parsed only when offered and not turned off.

        `tool_choice` is auto, none, required or function (then `tool_name` names it)."""
        name, thinking = self.tool, self.reasoning
        calls = bool(name and tools and tool_choice != "none")
        tool_parser: ToolParser | None = None
        splitter = None
        in_reasoning = False
        if "harmony" in (name, thinking):  # one parser reads Harmony's channels: reasoning, content and calls
            tool_parser = HarmonyParser(tools, make_id, calls=calls and name == "harmony")
        else:
            tool_parser = PARSERS[name](tools, make_id) if calls and name else None
            if thinking:
                in_reasoning = starts_in_reasoning(prompt_text, FORMATS[thinking])
                splitter = ReasoningSplitter(in_reasoning, FORMATS[thinking])
        forced = ""
        if tool_parser and tool_parser.parse_calls and tool_choice in ("required", "function") and not in_reasoning:
            forced = tool_parser.opening(tool_name if tool_choice == "function" else None)
        return ChatOutputParser(tool_parser, splitter, forced)


_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}


async def start_formats(tokenizer: Any, formats: ModelFormats, tool_setting: str) -> str | None:
    """At start: keep the markup tokens of the model's `formats` in decoded text (the parsers read them), and
    the warning for a template that renders tools in a markup no family reads (None when there is none). The
    probe renders as a request's do (PromptTokenizer.render_chat): on a worker, within --template-timeout."""
    tool, thinking = formats.tool, formats.reasoning
    if tool:
        PARSERS[tool].prepare()
    markers = [*(PARSERS[tool].special_markers if tool else ())]
    if thinking == "harmony":
        markers += HarmonyParser.special_markers
    elif thinking:
        markers += [FORMATS[thinking].open, FORMATS[thinking].close]
    tokenizer.keep_special([s for s in tokenizer.specials if any(s in m for m in markers)])
    if tool is not None or tool_setting != "auto":
        return None
    message = [{"role": "user", "content": "hi"}]
    try:
        if await tokenizer.render_chat(message, [_PROBE_TOOL]) == await tokenizer.render_chat(message):
            return None  # renders no tools: requests get the Hermes block (server/api/prepare.py)
    except ApiError:  # a template that refuses the probe, or runs past its time, says nothing about its markup
        return None
    return ("the chat template renders tools in a markup kvfork does not know: tool calls are not parsed "
            "(name the format with --tool-parser)")


def collect(events: list[Event]) -> ChatOutput:
    out = ChatOutput()
    content, reasoning = [], []
    for event in events:
        if isinstance(event, TextDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            out.tool_calls.append(ToolCall(event.id, event.name, ""))
        elif isinstance(event, ToolCallArguments):
            out.tool_calls[event.index].arguments += event.text
    out.content, out.reasoning = "".join(content), "".join(reasoning)
    return out
