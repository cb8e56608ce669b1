"""POST /v1/chat/completions: the body prepared (server/api/prepare.py), then answered by
`ChatReply` (reply.py), one per choice when n > 1.
"""

from __future__ import annotations

from aiohttp import web

from kvfork.server.api.chat.protocol import ChatCompletionRequest
from kvfork.server.api.chat.reply import ChatReply
from kvfork.server.api.diagnosis import asked_by
from kvfork.server.api.prepare import check_chat, prepare, request_id
from kvfork.server.api.respond import Choices, decoder, read_body, respond
from kvfork.server.common.state import services_of
from kvfork.server.guard.limits import check_count, check_sampling

DECODE = decoder(ChatCompletionRequest)


async def handle(request: web.Request) -> web.StreamResponse:
    services = services_of(request)
    body: ChatCompletionRequest = await read_body(request, DECODE)
    config = services.config
    check_sampling(body, config)
    check_count("tools", body.tools, config.max_tools, "--max-tools", "tools")
    rid = request_id("chatcmpl")
    checked = await check_chat(services, body, request, rid, services.models.known(body.model))
    model = await services.models.acquire(request, body.model, body.stream)
    job = await prepare(model, checked, request, rid, asked=asked_by(body.prompt_cache_options))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    tokenizer = model.require_ready() if body.logprobs else None
    if job.n == 1:
        return await respond(request, model, job, ChatReply(rid, job, tokenizer, include_usage), body.stream)
    # each choice parses its own output (tool calls, reasoning): a parser per choice
    replies = [ChatReply(rid, job, tokenizer, False, index=i, parser=job.parser.copy() if job.parser else None)
               for i in range(job.n)]
    return await respond(request, model, job, Choices(replies, include_usage), body.stream)
