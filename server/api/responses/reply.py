"""Chat output as a Responses reply: one `Response`, or the documented stream of events.

Output items follow the output parser's events in order: a reasoning item while
`<think>` text flows, a message item for content, one function_call item per
call. An item opens (output_item.added, and its content part) when the kind of
output changes, and closes (the .done events) before the next one opens, so
`output_index` follows output order and every delta names its item.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable

import msgspec

from kvfork.server.api.diagnosis import Report
from kvfork.server.generate.chat_output import ChatOutputParser
from kvfork.server.generate.generation import ChoiceFinished, Piece
from kvfork.server.guard.errors import ApiError
from kvfork.server.api.responses.protocol import (
    ArgumentsDelta, ArgumentsDone, ContentPartAdded, ContentPartDone, ErrorEvent, Event, FunctionCallOut,
    IncompleteDetails, InputTokensDetails, OutputItem, OutputItemAdded, OutputItemDone, OutputMessage, OutputText,
    OutputTextDelta, OutputTextDone, OutputTokensDetails, ReasoningOut, ReasoningText, ReasoningTextDelta,
    ReasoningTextDone, Response, ResponseCompleted, ResponseCreated, ResponseIncomplete, ResponseInProgress,
    ResponsesRequest, ResponseUsage, sse,
)
from kvfork.server.api.responses.translate import namespaces
from kvfork.server.api.sse import EventStream
from kvfork.server.toolcalls.base import Event as ParserEvent
from kvfork.server.toolcalls.base import ReasoningDelta, ToolCallArguments, ToolCallStart


def response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesEventStream(EventStream):
    """The Responses framing: `event:` + `data:` per event, numbered in sending order, no [DONE].

    Until the first output event, a keep-alive is `response.in_progress` sent again: Codex's idle
    timer (5 minutes) counts events, not SSE comments, and a CPU prefill of its prompt can take
    longer. Later keep-alives are comments."""

    def __init__(self, request):
        super().__init__(request)
        self.sequence = 0
        self.waiting: ResponseInProgress | None = None  # the in_progress event, until output begins

    async def send(self, event: Event) -> None:
        if isinstance(event, ResponseInProgress):
            self.waiting = event
        elif not isinstance(event, ResponseCreated):
            self.waiting = None
        event.sequence_number, self.sequence = self.sequence, self.sequence + 1
        await self.write(sse(event))

    async def keep_alive(self) -> None:
        if self.waiting is not None:
            await self.send(msgspec.structs.replace(self.waiting))
        else:
            await super().keep_alive()

    async def send_error(self, error: ApiError) -> None:
        await self.send(ErrorEvent(message=error.message, code=error.code, param=error.param))

    async def finish(self) -> None:
        await self.response.write_eof()


class _Open:
    """The output item being written."""

    def __init__(self, kind: str, index: int, id: str, name: str = "", call_id: str = ""):
        self.kind, self.index, self.id, self.name, self.call_id = kind, index, id, name, call_id
        self.text: list[str] = []


class ResponsesReply:
    """A Responses reply. `keep(response)` stores the response once it is complete, before its
    last event is sent, so a client may continue it the moment it reads that event."""

    stream_type = ResponsesEventStream

    def __init__(self, rid: str, model: str, parser: ChatOutputParser, body: ResponsesRequest,
                 keep: Callable[[Response], None] | None, diagnostics: Report | None = None):
        self.parser, self.keep, self.diagnostics = parser, keep, diagnostics
        self.namespaces = namespaces(body.tools)
        self.response = Response(
            id=rid, created_at=int(time.time()), model=model, status="in_progress", output=[],
            tools=[t for t in body.tools or () if t.get("type") == "function"],
            tool_choice=body.tool_choice or "auto",
            text={"format": msgspec.to_builtins(body.text.format) if body.text and body.text.format else {"type": "text"}},
            parallel_tool_calls=body.parallel_tool_calls, store=body.store, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, previous_response_id=body.previous_response_id,
            temperature=body.temperature, top_p=body.top_p, metadata=body.metadata or {},
        )
        if diagnostics is not None and diagnostics.diagnosis is not None:
            self.response.prompt_cache_diagnostics = diagnostics.openai()  # type: ignore[assignment]
        self._open: _Open | None = None
        self.finished = False

    def start(self) -> list[Event]:
        snapshot = msgspec.structs.replace(self.response, output=[])
        return [ResponseCreated(response=snapshot), ResponseInProgress(response=snapshot)]

    def piece(self, piece: Piece) -> list[Event]:
        return self._events(self.parser.feed(piece.text))

    def finish(self, done: ChoiceFinished) -> list[Event]:
        out = self._events(self.parser.finish())
        self._close(out)
        usage = done.usage
        self.response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(usage.reused_tokens),
            output_tokens=usage.generated_tokens, output_tokens_details=OutputTokensDetails(),
            total_tokens=usage.prompt_tokens + usage.generated_tokens,
        )
        if done.finish_reason == "length":
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails("max_output_tokens")
        else:
            self.response.status = "completed"
        account = self.diagnostics.ran(usage) if self.diagnostics is not None else None
        if account is not None:
            self.response.kvfork_cache = account
        if self.keep is not None:
            self.keep(self.response)
        self.finished = True
        last = ResponseCompleted if self.response.status == "completed" else ResponseIncomplete
        return out + [last(response=self.response)]

    def whole(self) -> Response:
        return self.response

    def _events(self, events: list[ParserEvent]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ToolCallStart):
                self._close(out)
                item = self._open = _Open("function_call", len(self.response.output), _item_id("fc"), event.name,
                                          event.id)
                out.append(OutputItemAdded(output_index=item.index, item=self._item(item, "in_progress")))
                continue
            if isinstance(event, ToolCallArguments):
                item = self._open
                assert item is not None and item.kind == "function_call"
                out.append(ArgumentsDelta(item_id=item.id, output_index=item.index, delta=event.text))
            else:
                reasoning = isinstance(event, ReasoningDelta)
                item = self._ensure("reasoning" if reasoning else "message", out)
                delta = ReasoningTextDelta if reasoning else OutputTextDelta
                out.append(delta(item_id=item.id, output_index=item.index, content_index=0, delta=event.text))
            item.text.append(event.text)
        return out

    def _ensure(self, kind: str, out: list[Event]) -> _Open:
        if self._open is not None and self._open.kind == kind:
            return self._open
        self._close(out)
        item = self._open = _Open(kind, len(self.response.output), _item_id("rs" if kind == "reasoning" else "msg"))
        out.append(OutputItemAdded(output_index=item.index, item=self._item(item, "in_progress")))
        out.append(ContentPartAdded(item_id=item.id, output_index=item.index, content_index=0, part=self._part(item)))
        return item

    def _close(self, out: list[Event]) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        text = "".join(item.text)
        if item.kind == "function_call":
            out.append(ArgumentsDone(item_id=item.id, output_index=item.index, arguments=text))
        else:
            done = ReasoningTextDone if item.kind == "reasoning" else OutputTextDone
            out.append(done(item_id=item.id, output_index=item.index, content_index=0, text=text))
            out.append(ContentPartDone(item_id=item.id, output_index=item.index, content_index=0,
                                       part=self._part(item, text)))
        whole = self._item(item, "completed", text)
        self.response.output.append(whole)
        out.append(OutputItemDone(output_index=item.index, item=whole))

    @staticmethod
    def _part(item: _Open, text: str = "") -> OutputText | ReasoningText:
        return ReasoningText(text) if item.kind == "reasoning" else OutputText(text)

    def _item(self, item: _Open, status: str, text: str = "") -> OutputItem:
        if item.kind == "function_call":
            return FunctionCallOut(item.id, item.call_id, item.name, text, status, self.namespaces.get(item.name))
        if item.kind == "reasoning":
            return ReasoningOut(item.id, [ReasoningText(text)] if text else [], status)
        return OutputMessage(item.id, status, [OutputText(text)] if text else [])
