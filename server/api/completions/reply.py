"""Generated text as an OpenAI text completion: one body, or the stream of chunks."""

from __future__ import annotations

import time

from kvfork.server.api.completions.protocol import Completion, CompletionChoice, CompletionLogprobs
from kvfork.server.api.respond import Job, usage_info
from kvfork.server.api.sse import EventStream
from kvfork.server.engine.api import Usage
from kvfork.server.generate.generation import ChoiceFinished, Piece
from kvfork.server.text.tokenizer import PromptTokenizer


class CompletionReply:
    """A text completion: chunks of text as released, or one body at the end; OpenAI's legacy
    logprobs block when asked for."""

    stream_type = EventStream

    def __init__(self, rid: str, job: Job, tokenizer: PromptTokenizer, logprobs: bool, echo: str,
                 include_usage: bool, index: int = 0):
        self.rid, self.created, self.model, self.index = rid, int(time.time()), job.model, index
        self.tokenizer, self.logprobs, self.echo, self.include_usage = tokenizer, logprobs, echo, include_usage
        self.offset = len(echo)
        self.texts = [echo]
        self.all_logprobs = CompletionLogprobs([], [], [], [])
        self.done: ChoiceFinished | None = None

    def start(self) -> list[Completion]:
        return [self._chunk(self.echo)] if self.echo else []

    def piece(self, piece: Piece) -> list[Completion]:
        self.texts.append(piece.text)
        logprobs = self._logprobs_of(piece) if self.logprobs else None
        return [self._chunk(piece.text, logprobs=logprobs)] if piece.text or logprobs else []

    def finish(self, done: ChoiceFinished) -> list[Completion]:
        self.done = done
        out = [self._chunk("", done.finish_reason)]
        if self.include_usage:
            out += self.usage(done.usage)
        return out

    def usage(self, usage: Usage) -> list[Completion]:
        return [Completion(self.rid, self.created, self.model, [], usage_info(usage))]

    def whole(self) -> Completion:
        assert self.done is not None
        choice = CompletionChoice(self.index, "".join(self.texts), self.done.finish_reason,
                                  self.all_logprobs if self.logprobs else None)
        return Completion(self.rid, self.created, self.model, [choice], usage_info(self.done.usage))

    def _chunk(self, text: str, finish: str | None = None, logprobs: CompletionLogprobs | None = None) -> Completion:
        return Completion(self.rid, self.created, self.model, [CompletionChoice(self.index, text, finish, logprobs)])

    def _logprobs_of(self, piece: Piece) -> CompletionLogprobs | None:
        out = CompletionLogprobs([], [], [], [])
        for event in piece.tokens:
            if event.logprob is None:
                continue
            text = self.tokenizer.token_text(event.token)
            out.tokens.append(text)
            out.token_logprobs.append(event.logprob)
            out.top_logprobs.append({self.tokenizer.token_text(t): lp for t, lp in event.top_logprobs or ()})
            out.text_offset.append(self.offset)
            self.offset += len(text)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.all_logprobs, name).extend(getattr(out, name))
        return out if out.tokens else None
