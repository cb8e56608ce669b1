"""Chat output as Anthropic Messages replies: whole, or as the stream of events.

`MessagesReply` is the route's reply (see server/api/respond.py): `MessageStream`
turns the output parser's events into Anthropic's: a content
block opens when the kind of output changes (thinking, text, one per tool call),
and closes before the next one opens, so block indices follow output order.
"""

from __future__ import annotations

import json
import uuid

import msgspec

from kvfork.server.api.diagnosis import Report
from kvfork.server.generate.chat_output import ChatOutput, ChatOutputParser, collect
from kvfork.server.generate.generation import ChoiceFinished, Piece
from kvfork.server.guard.errors import ApiError
from kvfork.server.api.messages.protocol import (
    AnthropicUsage,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ContentOut,
    InputJsonDelta,
    MessageDelta,
    MessageReply,
    MessageStart,
    MessageStop,
    StopDelta,
    StopReason,
    StreamEvent,
    TextDeltaOut,
    TextOut,
    ThinkingDeltaOut,
    ThinkingOut,
    ToolUseOut,
    error_reply,
    Ping,
    sse,
)
from kvfork.server.api.sse import EventStream
from kvfork.server.toolcalls.base import Event, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, reused_tokens: int, output_tokens: int) -> AnthropicUsage:
    # Anthropic's input_tokens leaves out what was read from the cache.
    return AnthropicUsage(prompt_tokens - reused_tokens, output_tokens, cache_read_input_tokens=reused_tokens)


def stop_reason(finish_reason: str, has_tool_calls: bool, stop_sequence: str | None) -> StopReason:
    if has_tool_calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _tool_input(arguments: str) -> dict:
    value = json.loads(arguments) if arguments else {}
    return value if isinstance(value, dict) else {}


def message_reply(
    id: str, model: str, output: ChatOutput, finish_reason: str, stop_sequence: str | None, usage: AnthropicUsage
) -> MessageReply:
    content: list[ContentOut] = []
    if output.reasoning:
        content.append(ThinkingOut(output.reasoning))
    if output.content:
        content.append(TextOut(output.content))
    content += [ToolUseOut(c.id, c.name, _tool_input(c.arguments)) for c in output.tool_calls]
    reason = stop_reason(finish_reason, bool(output.tool_calls), stop_sequence)
    return MessageReply(
        id=id, model=model, content=content, usage=usage, stop_reason=reason,
        stop_sequence=stop_sequence if reason == "stop_sequence" else None,
    )


class MessageStream:
    def __init__(self, id: str, model: str):
        self.id, self.model = id, model
        self._index = -1
        self._open: str | None = None  # kind of the open block: "thinking", "text" or "tool_use"
        self._tool_calls = 0

    def start(self, usage: AnthropicUsage) -> list[StreamEvent]:
        return [MessageStart(MessageReply(id=self.id, model=self.model, content=[], usage=usage))]

    def events(self, events: list[Event]) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                self._ensure("thinking", ThinkingOut(""), out)
                out.append(ContentBlockDelta(self._index, ThinkingDeltaOut(event.text)))
            elif isinstance(event, TextDelta):
                self._ensure("text", TextOut(""), out)
                out.append(ContentBlockDelta(self._index, TextDeltaOut(event.text)))
            elif isinstance(event, ToolCallStart):
                self._close(out)
                self._ensure("tool_use", ToolUseOut(event.id, event.name, {}), out)
                self._tool_calls += 1
            elif isinstance(event, ToolCallArguments):
                out.append(ContentBlockDelta(self._index, InputJsonDelta(event.text)))
        return out

    def finish(self, finish_reason: str, stop_sequence: str | None, usage: AnthropicUsage,
               kvfork_cache: dict | None = None) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        self._close(out)
        reason = stop_reason(finish_reason, self._tool_calls > 0, stop_sequence)
        delta = StopDelta(reason, stop_sequence if reason == "stop_sequence" else None)
        return out + [MessageDelta(delta, usage, kvfork_cache or msgspec.UNSET), MessageStop()]

    def _ensure(self, kind: str, block: ContentOut, out: list[StreamEvent]) -> None:
        if self._open == kind:
            return
        self._close(out)
        self._index += 1
        self._open = kind
        out.append(ContentBlockStart(self._index, block))

    def _close(self, out: list[StreamEvent]) -> None:
        if self._open is not None:
            out.append(ContentBlockStop(self._index))
            self._open = None


class MessagesEventStream(EventStream):
    """Anthropic's SSE framing: `event:` + `data:` per event, pings as keep-alives, no [DONE].
    A stream opens with message_start: before it, keep-alives are SSE comments."""

    started = False

    async def send(self, event) -> None:
        self.started = self.started or isinstance(event, MessageStart)
        await self.write(sse(event))

    async def send_error(self, error: ApiError) -> None:
        await self.send(error_reply(error.status, error.message))

    async def keep_alive(self) -> None:
        if self.started:
            await self.send(Ping())
        else:
            await super().keep_alive()

    async def finish(self) -> None:
        await self.response.write_eof()


class MessagesReply:
    """A Messages reply: the stream's events as the parser releases output, or one body at the end.

    message_start waits for the first token (or the end), when the prompt's split between cached
    and computed tokens is known: as Anthropic's does, it carries the input usage message_delta ends
    with."""

    stream_type = MessagesEventStream

    def __init__(self, id: str, model: str, prompt_tokens: int, parser: ChatOutputParser,
                 diagnostics: Report | None = None):
        self.id, self.model, self.prompt_tokens, self.parser = id, model, prompt_tokens, parser
        self.diagnostics = diagnostics
        self.stream = MessageStream(id, model)
        self.events: list[Event] = []
        self.done: ChoiceFinished | None = None
        self.started = False

    def start(self) -> list[StreamEvent]:
        return []

    def piece(self, piece: Piece) -> list[StreamEvent]:
        out = self._start(piece.reused) if not self.started else []
        events = self.parser.feed(piece.text)
        self.events += events
        return out + self.stream.events(events)

    def finish(self, done: ChoiceFinished) -> list[StreamEvent]:
        self.done = done
        out = self._start(done.usage.reused_tokens) if not self.started else []
        events = self.parser.finish()
        self.events += events
        account = self.diagnostics.ran(done.usage) if self.diagnostics is not None else None
        return out + self.stream.events(events) + self.stream.finish(done.finish_reason, done.stop_string,
                                                                     self._usage(), account)

    def _start(self, reused: int) -> list[StreamEvent]:
        self.started = True
        start = self.stream.start(usage(self.prompt_tokens, reused, 0))
        if self.diagnostics is not None:
            start[0].message.diagnostics = self.diagnostics.anthropic()  # type: ignore[union-attr]
        return start

    def whole(self) -> MessageReply:
        assert self.done is not None
        body = message_reply(self.id, self.model, collect(self.events), self.done.finish_reason,
                             self.done.stop_string, self._usage())
        if self.diagnostics is not None:
            body.diagnostics = self.diagnostics.anthropic()
            body.kvfork_cache = self.diagnostics.account or msgspec.UNSET
        return body

    def _usage(self) -> AnthropicUsage:
        assert self.done is not None
        used = self.done.usage
        return usage(used.prompt_tokens, used.reused_tokens, used.generated_tokens)
