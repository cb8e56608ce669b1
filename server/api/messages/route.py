"""POST /v1/messages (+ streaming) and POST /v1/messages/count_tokens: Anthropic's Messages API.

A Messages body is translated into the chat request it means
(translate.py) and prepared by the one `prepare` (server/api/prepare.py), so
an agent history sent here renders to the same prompt tokens as through chat
completions and gets the same prefix-cache and active reuse. Errors on these
routes use Anthropic's shape: the error middleware picks it by path (PATH); a
prompt over the context is refused in Anthropic's words.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from aiohttp import web

from kvfork.server.api.chat.protocol import ChatCompletionRequest
from kvfork.server.api.diagnosis import Asked
from kvfork.server.api.messages.protocol import CountTokensRequest, MessagesRequest, TokenCount
from kvfork.server.api.messages.reply import MessagesReply, message_id, tool_use_id
from kvfork.server.api.messages.translate import UnsupportedContent, chat_request, dropped_tools, items_over
from kvfork.server.api.prepare import Checked, check_chat, prepare, render_prompt
from kvfork.server.api.respond import decoder, json_response, read_body, report_dropped_tools, respond
from kvfork.server.api.volatile import strip_system
from kvfork.server.common.state import ModelBounds, Services, services_of, tenant_of
from kvfork.server.engine.api import ContextTooLong
from kvfork.server.guard.errors import ApiError, from_decode, invalid
from kvfork.server.guard.limits import check_stops, over

PATH = "/v1/messages"
DECODE_MESSAGES = decoder(MessagesRequest)
DECODE_COUNT = decoder(CountTokensRequest)
MessagesRequestT = TypeVar("MessagesRequestT", MessagesRequest, CountTokensRequest)


def as_chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    try:
        chat = chat_request(body)
    except UnsupportedContent as e:
        raise ApiError(400, str(e), code="unsupported_content", param="messages") from None
    except ValueError as e:  # the message names the field
        raise invalid(str(e).split(":", 1)[0], str(e)) from None
    try:
        return msgspec.convert(chat, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise from_decode(e) from None


def without_volatile_lines(services: Services, body: MessagesRequestT) -> MessagesRequestT:
    """The body without the volatile lines of server/api/volatile.py (unless --keep-volatile-lines),
    each one counted in /metrics."""
    if services.config.keep_volatile_lines:
        return body
    system, removed = strip_system(body.system)
    for name in removed:
        services.volatile_lines.inc(line=name)
    return msgspec.structs.replace(body, system=system) if removed else body


async def handle(request: web.Request) -> web.StreamResponse:
    services = services_of(request)
    body: MessagesRequest = without_volatile_lines(services, await read_body(request, DECODE_MESSAGES))
    limits = services.config
    check_stops("stop_sequences", body.stop_sequences, limits.max_stop_sequences, "--max-stop-sequences", limits)
    rid = message_id()
    checked = await checked_chat(services, body, request, rid, services.models.known(body.model))
    report_dropped_tools(request, dropped_tools(body))
    model = await services.models.acquire(request, body.model, body.stream)
    asked = Asked(body.diagnostics.previous_message_id) if body.diagnostics is not None else None
    try:
        job = await prepare(model, checked, request, rid, make_call_id=tool_use_id, asked=asked)
        reply = MessagesReply(rid, job.model, len(job.prompt), job.parser, job.diagnostics)
        return await respond(request, model, job, reply, body.stream)
    except ContextTooLong as e:
        # Anthropic's own words: Claude Code reads the numbers out of them to compact its history. The most a
        # prompt may hold is the context less the one token it must leave for output; a long prompt refused on
        # its prefix says the tokens counted there (fewer than it holds, more than the maximum).
        raise ApiError(400, f"prompt is too long: {e.tokens} tokens > {e.context - 1} maximum",
                       code="context_length_exceeded") from None


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt tokens a Messages request would take, as Anthropic's count_tokens answers: a count on the
    model's tokenizer, never a generation. A model not loaded is not loaded for it: its tokenizer alone is
    (Models.counting)."""
    services = services_of(request)
    body: CountTokensRequest = without_volatile_lines(services, await read_body(request, DECODE_COUNT))
    tokenizer, formats, context = await services.models.counting(request, body.model)
    checked = await checked_chat(services, body, request, "count_tokens", ModelBounds(context, None))
    rendered = await render_prompt(tokenizer, formats, services.config, checked, context, tenant_of(request),
                                   count_all=True)
    return json_response(TokenCount(len(rendered.prompt)))


async def checked_chat(services: Services, body: MessagesRequest | CountTokensRequest, request: web.Request,
                       rid: str, known: ModelBounds | None) -> Checked:
    """The chat request a Messages body means, checked (prepare.check_chat) for a model `known` before it is
    acquired (None: not yet); its messages and content blocks are counted before they are translated."""
    limits = services.config
    count = items_over(body, limits.max_messages)
    if count is not None:
        raise over("messages", f"messages hold {count:,} or more messages and content blocks", limits.max_messages,
                   "--max-messages", "array_above_max_length")
    return await check_chat(services, as_chat_request(body), request, rid, known)
