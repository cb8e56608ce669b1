"""POST /v1/chat/completions.

`prepare` is the one path from a chat request to prompt tokens and an output
parser; the Anthropic and Responses routes translate their bodies into a chat
request and take the same path, so every API gets the same tokens and reuse.
Tools: checking tools and tool_choice, feeding past calls back to templates
(or, for templates that render no tools, the Hermes block: toolcalls/hermes.py),
and saying parsed output in OpenAI's message and delta shapes.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from aiohttp import web

from server.chat_output import ChatOutput, ChatOutputParser, collect, output_parser
from server.engine.api import TokenEvent, Usage
from server.errors import ApiError, invalid, unsupported
from server.generation import Finished, Piece
from server.grammar import request_ask
from server.api.openai import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
    ChoiceLogprobs, ChunkChoice, Delta, FunctionCall, FunctionDelta, TokenLogprob, ToolCallDelta, ToolCallOut,
    TopLogprob,
)
from server.api.respond import Choices, Job, decoder, read_body, respond, usage_info
from server.sampling import check_supported, generate_request, request_id, session_id, stop_strings
from server.sse import EventStream
from server.state import AppState, scope_of, state_of
from server.text.tokenizer import PromptTokenizer
from server.toolcalls import resolve_tool_parser
from server.toolcalls.base import Event, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart, openai_call_id
from server.toolcalls.hermes import with_tools_block

DECODE = decoder(ChatCompletionRequest)


def check_tools(tools: list[dict[str, Any]] | None) -> list[str]:
    """The function names offered; 400 naming the tool that is not a function with a name."""
    names = []
    for i, tool in enumerate(tools or ()):
        function = tool.get("function")
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if tool.get("type") != "function" or not named:
            raise invalid(f"tools[{i}]", 'a tool is {"type": "function", "function": {"name": ..., "parameters": ...}}')
        names.append(function["name"])
    return names


def tool_choice_of(choice: str | dict[str, Any] | None, names: list[str]) -> tuple[str, str | None]:
    """(auto | none | required | function, the named function)."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid("tool_choice", f"tool_choice is auto, none, required or a function, got {choice!r}")
        if choice == "required" and not names:
            raise invalid("tool_choice", "tool_choice 'required' needs tools")
        return choice, None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise invalid("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise invalid("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return "function", name


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as templates read them: JSON-object arguments as objects.

    OpenAI clients send arguments as JSON text, but many templates render them
    with `tojson` (Llama 3, Qwen2.5): text would come out quoted twice.
    """
    out = []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


def template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: text content, the other fields passed through."""
    content = message.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text":
                raise ApiError(400, f"content parts of type {part.type!r} are not supported; send text",
                               code="unsupported_content", param=f"messages[{index}].content[{j}]")
        content = "\n".join(part.text or "" for part in content)
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    if message.tool_calls is not None:
        out["tool_calls"] = template_tool_calls(message.tool_calls)
    return out


def inline_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages for a template that refuses a system message anywhere but first (Gemma's,
    Qwen3.5's): the leading system messages joined into one, and each later one merged into the
    adjacent user turn (the next, else the one before), marked as system text; one with no user
    turn beside it becomes a user turn of its own. The request is served, never refused for it."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] != "system":
            out.append(dict(message))
        elif all(m["role"] == "system" for m in out):  # still in the leading run
            if out:
                out[0]["content"] += "\n\n" + message["content"]
            else:
                out.append(dict(message))
        else:
            out.append({**message, "role": "user", "content": f"<system>\n{message['content']}\n</system>",
                        "inlined": True})
    for i, message in enumerate(out):  # each marked turn joins a user turn beside it
        if not message.pop("inlined", False):
            continue
        after = out[i + 1] if i + 1 < len(out) else None
        if after is not None and after["role"] == "user" and not after.get("inlined"):
            after["content"] = message["content"] + "\n\n" + after["content"]
            message["role"] = None
            continue
        before = next(m for m in reversed(out[:i]) if m["role"] is not None)
        if before["role"] == "user":
            before["content"] += "\n\n" + message["content"]
            message["role"] = None
    return [m for m in out if m["role"] is not None]


async def prepare(state: AppState, body: ChatCompletionRequest, request: web.Request, rid: str,
                  make_call_id: Callable[[], str] = openai_call_id) -> Job:
    check_supported(body, state.config.max_n)
    if body.top_logprobs and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    messages = [template_message(i, m) for i, m in enumerate(body.messages)]
    choice, tool_name = tool_choice_of(body.tool_choice, check_tools(body.tools))
    model = state.model_name(body.model)
    tokenizer = state.require_ready()
    session = session_id(body.session_id, request.headers, state.config.session_header)
    config = state.config
    kwargs = body.chat_template_kwargs
    try:
        text = await tokenizer.render_chat(messages, body.tools, kwargs)
    except ApiError:
        inlined = inline_system_messages(messages)
        if inlined == messages:
            raise
        messages = inlined
        text = await tokenizer.render_chat(messages, body.tools, kwargs)
    rendered = messages, body.tools
    tool_format = config.tool_parser
    if body.tools and tool_format == "auto" and resolve_tool_parser("auto", tokenizer.chat_template) is None:
        # A template that teaches no tool format may still render tools its own way; only one that
        # renders none at all (the text is the same without them) gets the Hermes block.
        if text == await tokenizer.render_chat(messages, None, kwargs):
            rendered = with_tools_block(messages, body.tools), None
            text = await tokenizer.render_chat(*rendered, kwargs)
            tool_format = "hermes"
    parser = output_parser(tool_format, config.reasoning_parser, tokenizer.chat_template, text, body.tools,
                           choice, tool_name, make_call_id)
    prompt = await tokenizer.encode_rendered(text)
    if parser.prompt_suffix:  # encoded on its own: the prompt before it keeps the tokens other turns share
        prompt += await tokenizer.encode_rendered(parser.prompt_suffix)
    generate = generate_request(
        body, prompt, rid=rid, vocab_size=state.engine.info.vocab_size,
        max_tokens=body.max_completion_tokens or body.max_tokens, session=session,
        scope=scope_of(request, body.cache_salt), logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0,
    )
    ask = request_ask(body.response_format, parser.tool_parser.name if parser.tool_parser else None, body.tools,
                      choice, tool_name, parser.prompt_suffix,  # type: ignore[arg-type]
                      parallel=body.parallel_tool_calls is not False)
    if ask is not None:
        generate.constraint = await state.grammars().compile(ask)
    checkpoints = state.engine.recurrent_checkpoints
    if checkpoints:  # a hybrid model keeps its recurrent state where messages end: find them
        generate.boundaries = await tokenizer.message_ends(*rendered, kwargs, prompt, checkpoints)
    return Job(model, prompt, generate, stop_strings(body), parser, body.n)


async def handle(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body: ChatCompletionRequest = await read_body(request, DECODE)
    rid = request_id("chatcmpl")
    job = await prepare(state, body, request, rid)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    tokenizer = state.require_ready() if body.logprobs else None
    if job.n == 1:
        return await respond(request, state, job, ChatReply(rid, job, tokenizer, include_usage), body.stream)
    # each choice parses its own output (tool calls, reasoning): a parser per choice
    replies = [ChatReply(rid, job, tokenizer, False, index=i, parser=job.parser.copy() if job.parser else None)
               for i in range(job.n)]
    return await respond(request, state, job, Choices(replies, include_usage), body.stream)


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
        self.done: Finished | None = None

    def start(self) -> list[ChatCompletionChunk]:
        return [self._chunk(Delta(role="assistant", content=""))]

    def piece(self, piece: Piece) -> list[ChatCompletionChunk]:
        events = self.parser.feed(piece.text)
        self.events += events
        logprobs = token_logprobs(piece.tokens, self.tokenizer) if self.tokenizer else []
        self.logprobs += logprobs
        out = deltas(events) or ([Delta(content="")] if logprobs else [])
        # the piece's logprobs ride on its first chunk
        return [self._chunk(delta, logprobs=logprobs if i == 0 else None) for i, delta in enumerate(out)]

    def finish(self, done: Finished) -> list[ChatCompletionChunk]:
        self.done = done
        events = self.parser.finish()
        self.events += events
        out = [self._chunk(delta) for delta in deltas(events)]
        out.append(self._chunk(Delta(), finish_reason=finish_reason(done.finish_reason, self._has_calls())))
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
        return ChatCompletion(self.rid, self.created, self.model, [choice], usage_info(self.done.usage))

    def _has_calls(self) -> bool:
        return any(isinstance(e, ToolCallStart) for e in self.events)

    def _chunk(self, delta: Delta, *, finish_reason: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> ChatCompletionChunk:
        choice = ChunkChoice(self.index, delta, finish_reason, ChoiceLogprobs(logprobs) if logprobs else None)
        return ChatCompletionChunk(self.rid, self.created, self.model, [choice])
