"""POST /v1/messages (+ streaming) and POST /v1/messages/count_tokens: Anthropic's Messages API.

A Messages body is translated into the chat request it means
(messages_api/translate.py) and prepared by the chat route's own `prepare`, so
an agent history sent here renders to the same prompt tokens as through chat
completions and gets the same prefix-cache and active reuse. Errors on these
routes use Anthropic's shape: the error middleware picks it by path (PATH).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from server.chat_output import collect
from server.errors import ApiError, from_decode, invalid
from server.generation import Finished, KeepAlive, Piece, generation
from server.messages_api.reply import MessageStream, message_id, message_reply, tool_use_id, usage
from server.messages_api.translate import UnsupportedContent, chat_request
from server.protocol.anthropic import CountTokensRequest, MessagesRequest, Ping, TokenCount, error_reply, sse
from server.protocol.openai import ChatCompletionRequest
from server.routes.chat import PreparedChat, prepare
from server.routes.common import decoder, json_response, read_body
from server.sse import EventStream
from server.state import AppState, state_of

PATH = "/v1/messages"
DECODE_MESSAGES = decoder(MessagesRequest)
DECODE_COUNT = decoder(CountTokensRequest)


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


async def handle(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body: MessagesRequest = await read_body(request, DECODE_MESSAGES)
    rid = message_id()
    chat = await prepare(state, as_chat_request(body), request, rid, make_call_id=tool_use_id)
    if body.stream:
        return await _stream(request, state, chat, rid)
    outputs = []
    async with generation(state.engine, chat.generate, state.require_ready(), chat.stops) as events:
        async for event in events:
            if isinstance(event, Piece):
                outputs += chat.parser.feed(event.text)
            elif isinstance(event, Finished):
                output = collect(outputs + chat.parser.finish())
                used = usage(event.usage.prompt_tokens, event.usage.reused_tokens, event.usage.generated_tokens)
                return json_response(message_reply(rid, chat.model, output, event.finish_reason, event.stop_string,
                                                   used))
    raise ApiError(503, "the engine ended the request without a result", code="engine_error")


async def count_tokens(request: web.Request) -> web.Response:
    state = state_of(request)
    body: CountTokensRequest = await read_body(request, DECODE_COUNT)
    chat = await prepare(state, as_chat_request(body), request, message_id())
    return json_response(TokenCount(len(chat.prompt)))


class MessagesEventStream(EventStream):
    """Anthropic's SSE framing: `event:` + `data:` per event, pings as keep-alives, no [DONE]."""

    async def send(self, event) -> None:
        await self.write(sse(event))

    async def send_error(self, error: ApiError) -> None:
        await self.send(error_reply(error.status, error.message))

    async def keep_alive(self) -> None:
        await self.send(Ping())

    async def finish(self) -> None:
        await self.response.write_eof()


async def _stream(request: web.Request, state: AppState, chat: PreparedChat, rid: str) -> web.StreamResponse:
    reply = MessageStream(rid, chat.model)
    async with (generation(state.engine, chat.generate, state.require_ready(), chat.stops,
                           keepalive_s=state.config.sse_keepalive) as events,
                MessagesEventStream(request) as stream):
        for out in reply.start(len(chat.prompt)):
            await stream.send(out)
        async for event in events:
            if isinstance(event, KeepAlive):
                await stream.keep_alive()
            elif isinstance(event, Piece):
                for out in reply.events(chat.parser.feed(event.text)):
                    await stream.send(out)
                await stream.keep_alive_if_quiet(state.config.sse_keepalive)
            elif isinstance(event, Finished):
                used = usage(event.usage.prompt_tokens, event.usage.reused_tokens, event.usage.generated_tokens)
                for out in reply.events(chat.parser.finish()) + reply.finish(event.finish_reason,
                                                                             event.stop_string, used):
                    await stream.send(out)
    return stream.response
