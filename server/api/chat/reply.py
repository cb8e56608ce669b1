"""Chat output as an OpenAI chat completion: one body, or the stream of chunks
(the parsed output in OpenAI's message and delta shapes, and its logprobs)."""

from __future__ import annotations

import time

import msgspec

from kvfork.server.engine.api import TokenEvent, Usage
from kvfork.server.generate.chat_output import ChatOutput, ChatOutputParser, collect
from kvfork.server.generate.generation import ChoiceFinished, Piece
from kvfork.server.api.chat.protocol import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChoiceLogprobs, ChunkChoice, Delta,
    FunctionCall, FunctionDelta, TokenLogprob, ToolCallDelta, ToolCallOut, TopLogprob,
)
from kvfork.server.api.respond import Job, usage_info
from kvfork.server.api.sse import EventStream
from kvfork.server.text.tokenizer import PromptTokenizer
from kvfork.server.toolcalls.base import Event, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart


def token_logprobs(events: list[TokenEvent], tokenizer: PromptTokenizer) -> list[TokenLogprob]:
    def entry(token: int, logprob: float) -> TopLogprob:
        text = tokenizer.token_text(token)
        return TopLogprob(text, logprob, list(text.encode()))

    out = []
    for event in events:
        if event.logprob is None:
            continue
        top = [entry(t, lp) for t, lp in event.top_logprobs or ()]
        head = entry(event.token, event.logprob)
        out.append(TokenLogprob(head.token, head.logprob, head.bytes, top))
    return out


def assistant_message(output: ChatOutput) -> AssistantMessage:
    calls = [ToolCallOut(c.id, FunctionCall(c.name, c.arguments)) for c in output.tool_calls]
    content = output.content if output.content or not calls else None
    return AssistantMessage("assistant", content, reasoning_content=output.reasoning or None, tool_calls=calls or None)


def finish_reason(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason == "stop" else reason


def deltas(events: list[Event]) -> list[Delta]:
    out = []
    for event in events:
        if isinstance(event, TextDelta):
            out.append(Delta(content=event.text))
        elif isinstance(event, ReasoningDelta):
            out.append(Delta(reasoning_content=event.text))
        elif isinstance(event, ToolCallStart):
            start = ToolCallDelta(event.index, FunctionDelta(event.name, ""), id=event.id, type="function")
            out.append(Delta(tool_calls=[start]))
        elif isinstance(event, ToolCallArguments):
            out.append(Delta(tool_calls=[ToolCallDelta(event.index, FunctionDelta(arguments=event.text))]))
    return out


class ChatReply:
    """A chat completion: chunks as the parser releases output, or one body at the end.
    `tokenizer` is given when the request asked for logprobs."""

    stream_type = EventStream

    def __init__(self, rid: str, job: Job, tokenizer: PromptTokenizer | None, include_usage: bool,
                 index: int = 0, parser: ChatOutputParser | None = None):
        self.rid, self.created, self.model = rid, int(time.time()), job.model
        self.parser = parser or job.parser
        self.tokenizer, self.include_usage, self.index = tokenizer, include_usage, index
        self.events: list[Event] = []
        self.logprobs: list[TokenLogprob] = []
        self.calls = False
        self.done: ChoiceFinished | None = None
        self.diagnostics = job.diagnostics if index == 0 else None  # said once, by choice 0

    def start(self) -> list[ChatCompletionChunk]:
        first = self._chunk(Delta(role="assistant", content=""))
        if self.diagnostics is not None and self.diagnostics.diagnosis is not None:
            first.prompt_cache_diagnostics = self.diagnostics.openai()  # type: ignore[assignment]
        return [first]

    def piece(self, piece: Piece) -> list[ChatCompletionChunk]:
        events = self.parser.feed(piece.text)
        self.events += events
        logprobs = token_logprobs(piece.tokens, self.tokenizer) if self.tokenizer else []
        self.logprobs += logprobs
        out = deltas(events) or ([Delta(content="")] if logprobs else [])
        # the piece's logprobs ride on its first chunk
        return [self._chunk(delta, logprobs=logprobs if i == 0 else None) for i, delta in enumerate(out)]

    def finish(self, done: ChoiceFinished) -> list[ChatCompletionChunk]:
        self.done = done
        events = self.parser.finish()
        self.events += events
        out = [self._chunk(delta) for delta in deltas(events)]
        out.append(self._chunk(Delta(), finish_reason=finish_reason(done.finish_reason, self._has_calls())))
        account = self.diagnostics.ran(done.usage) if self.diagnostics is not None else None
        if account is not None:
            out[-1].kvfork_cache = account
        if self.include_usage:
            out += self.usage(done.usage)
        return out

    def usage(self, usage: Usage) -> list[ChatCompletionChunk]:
        return [ChatCompletionChunk(self.rid, self.created, self.model, [], usage_info(usage))]

    def whole(self) -> ChatCompletion:
        assert self.done is not None
        output = collect(self.events)
        choice = ChatChoice(self.index, assistant_message(output), finish_reason(self.done.finish_reason, bool(output.tool_calls)),
                            ChoiceLogprobs(self.logprobs) if self.tokenizer else None)
        body = ChatCompletion(self.rid, self.created, self.model, [choice], usage_info(self.done.usage))
        if self.diagnostics is not None and self.diagnostics.diagnosis is not None:
            body.prompt_cache_diagnostics = self.diagnostics.openai()  # type: ignore[assignment]
            body.kvfork_cache = self.diagnostics.account or msgspec.UNSET
        return body

    def _has_calls(self) -> bool:
        return any(isinstance(e, ToolCallStart) for e in self.events)

    def _chunk(self, delta: Delta, *, finish_reason: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> ChatCompletionChunk:
        choice = ChunkChoice(self.index, delta, finish_reason, ChoiceLogprobs(logprobs) if logprobs else None)
        return ChatCompletionChunk(self.rid, self.created, self.model, [choice])
