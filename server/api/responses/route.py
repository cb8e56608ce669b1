"""POST /v1/responses: OpenAI's Responses API, for Codex CLI and the Agents SDK.

A Responses body is translated into the chat request it means
(translate.py), with the stored history of `previous_response_id`
in front of its input, and prepared by the one `prepare` (server/api/prepare.py): the same
prompt tokens, prefix cache and active reuse as its chat twin. Stored responses
and the named sessions that keep conversations warm: store.py.
GET and DELETE /v1/responses/{id} read and drop a stored response.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from kvfork.server.api.chat.protocol import ChatCompletionRequest
from kvfork.server.api.diagnosis import asked_by
from kvfork.server.api.prepare import check_chat, prepare
from kvfork.server.api.respond import decoder, json_response, read_body, report_dropped_tools, respond
from kvfork.server.api.responses.protocol import Response, ResponseDeleted, ResponsesRequest
from kvfork.server.api.responses.reply import ResponsesReply, response_id
from kvfork.server.api.responses.store import RESPONSES
from kvfork.server.api.responses.translate import chat_messages, chat_request, tool_functions, tool_count
from kvfork.server.common.state import services_of, tenant_of
from kvfork.server.guard.errors import ApiError, from_decode
from kvfork.server.guard.limits import check_count, over

PATH = "/v1/responses"
DECODE = decoder(ResponsesRequest)
# The chat request's names for the fields a Responses body calls otherwise, for errors.
_PARAMS = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}


async def handle(request: web.Request) -> web.StreamResponse:
    services = services_of(request)
    body: ResponsesRequest = await read_body(request, DECODE)
    limits = services.config
    if (tools := tool_count(body.tools)) > limits.max_tools:  # a namespace's functions each count
        raise over("tools", f"tools holds {tools:,} tools, counting each function of a namespace",
                   limits.max_tools, "--max-tools", "array_above_max_length")
    report_dropped_tools(request, tool_functions(body.tools)[1])  # a tool not an object with a string type: 400
    if isinstance(body.input, list):  # before they are translated: each item is work on the loop
        check_count("input", body.input, limits.max_messages, "--max-messages", "items")
    rid = response_id()
    store, tenant = request.app[RESPONSES], tenant_of(request)
    previous = body.previous_response_id
    history = (store.history(previous, tenant) if previous is not None else []) + chat_messages(body.input)
    if body.store:
        store.check_room(history, tenant)
    session = store.claim(previous, rid) if body.store and previous is not None else None
    reply = None
    try:
        try:
            chat = msgspec.convert(chat_request(body, history, session), ChatCompletionRequest)
            checked = await check_chat(services, chat, request, rid, services.models.known(body.model))
            model = await services.models.acquire(request, body.model, body.stream)
            job = await prepare(model, checked, request, rid, asked=asked_by(body.prompt_cache_options))
        except msgspec.ValidationError as e:
            raise _renamed(from_decode(e)) from None
        except ApiError as e:
            raise _renamed(e) from None

        def keep(response: Response) -> None:
            store.put(response, history + chat_messages(msgspec.to_builtins(response.output)), session, tenant)

        reply = ResponsesReply(rid, job.model, job.parser, body, keep if body.store else None, job.diagnostics)
        return await respond(request, model, job, reply, body.stream)
    finally:
        if session is not None and (reply is None or not reply.finished):
            store.give_back(session, rid, previous)


async def retrieve(request: web.Request) -> web.Response:
    stored = request.app[RESPONSES].get(request.match_info["response_id"], tenant_of(request))
    return json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    request.app[RESPONSES].delete(rid, tenant_of(request))
    return json_response(ResponseDeleted(rid))


def _renamed(error: ApiError) -> ApiError:
    head = (error.param or "").split(".", 1)[0].split("[", 1)[0]
    if head in _PARAMS:
        error.param = _PARAMS[head] + (error.param or "")[len(head):]
    return error
