"""POST /v1/completions: a prompt given as text or as token ids."""

from __future__ import annotations

import msgspec
from aiohttp import web

from kvfork.server.api.completions.protocol import CompletionRequest
from kvfork.server.api.completions.reply import CompletionReply
from kvfork.server.api.prepare import generate_request, request_id, session_id, stop_strings, token_ids
from kvfork.server.api.respond import Choices, Job, decoder, read_body, respond
from kvfork.server.common.state import scope_of, services_of
from kvfork.server.guard.errors import ApiError, invalid, unsupported
from kvfork.server.guard.limits import Limits, check_sampling, over
from kvfork.server.text.tokenizer import PromptTokenizer

DECODE = decoder(CompletionRequest)
_PROMPT = msgspec.json.Decoder(str | list[str | int | list[int]])


def prompt_value(raw: msgspec.Raw, context: int, limits: Limits) -> str | list[int]:
    """The body's prompt, checked against a model of `context` tokens: text within --max-prompt-chars, or token
    ids fewer than the context. Token ids are counted before they are decoded (their commas, at C speed): 3
    million of them cost the loop 160 ms to decode, and a prompt past the context is refused without it."""
    data = bytes(raw)
    if data[:1] == b"[" and data.lstrip(b"[ \t\r\n")[:1] in b"-0123456789" and data.count(b",") + 1 >= context:
        raise ApiError(400, f"the prompt has {data.count(b',') + 1:,} tokens or more; the context holds "
                       f"{context:,}, prompt and output together", code="context_length_exceeded", param="prompt")
    try:
        prompt = _PROMPT.decode(data)
    except msgspec.ValidationError as e:
        raise invalid("prompt", f"the prompt is a string, a list of token ids, or a list holding one of those "
                      f"({e})") from None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise unsupported("prompt", "a batch of prompts is not supported; send one request per prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        max_chars = limits.prompt_chars(context)
        if len(prompt) > max_chars:
            raise over("prompt", f"the prompt is {len(prompt):,} characters long", max_chars, "--max-prompt-chars")
        return prompt
    if not all(isinstance(t, int) for t in prompt):
        raise invalid("prompt", "the prompt is a string, a list of token ids, or a list holding one of those")
    if len(prompt) >= context:
        raise ApiError(400, f"the prompt has {len(prompt):,} tokens; the context holds {context:,}, prompt and "
                       "output together", code="context_length_exceeded", param="prompt")
    return prompt


def check_ids(prompt: str | list[int], vocab_size: int) -> None:
    """A prompt of token ids names ids of a vocabulary of `vocab_size`; a 400 else (text passes)."""
    if isinstance(prompt, list) and any(not 0 <= t < vocab_size for t in prompt):
        raise invalid("prompt", f"prompt token ids must be in [0, {vocab_size})")


async def prompt_tokens(prompt: str | list[int], tokenizer: PromptTokenizer, vocab_size: int, context: int,
                        tenant: str = "") -> list[int]:
    """A checked prompt's token ids: text tokenized (a long one that cannot fit `context` refused on its prefix:
    PromptTokenizer.within), ids checked against the vocabulary."""
    if isinstance(prompt, str):
        tokens = await tokenizer.text(prompt, tenant, context)
    else:
        check_ids(prompt, vocab_size)
        tokens = prompt
    if not tokens:
        raise invalid("prompt", "the prompt is empty")
    return tokens


async def handle(request: web.Request) -> web.StreamResponse:
    services = services_of(request)
    body: CompletionRequest = await read_body(request, DECODE)
    check_sampling(body, services.config)
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "best_of > 1 is not supported yet")
    if body.suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported")
    if body.echo and body.logprobs is not None:
        raise unsupported("echo", "echo with logprobs is not supported: prompt logprobs are not computed")
    session = session_id(body.session_id, request.headers, services.config.session_header)
    known = services.models.known(body.model)
    if known is not None:
        checked = prompt_value(body.prompt, known.context, services.config)
        if known.vocab_size is not None:
            token_ids(body, known.vocab_size)
            check_ids(checked, known.vocab_size)
    model = await services.models.acquire(request, body.model, body.stream)  # the checks above need no loaded model
    name = model.model_name(body.model)
    tokenizer = model.require_ready()
    if known is None or known.context != model.context:
        checked = prompt_value(body.prompt, model.context, services.config)
    vocab = model.info.vocab_size
    scope = scope_of(request, body.cache_salt)
    prompt = await prompt_tokens(checked, tokenizer, vocab, model.context, scope.tenant)
    rid = request_id("cmpl")
    generate = generate_request(
        body, prompt, rid=rid, vocab_size=vocab,
        max_tokens=body.max_tokens, session=session, scope=scope,
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
    )
    job = Job(name, prompt, generate, stop_strings(body), n=body.n)
    echo = tokenizer.decode(prompt) if body.echo else ""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if job.n == 1:
        reply = CompletionReply(rid, job, tokenizer, body.logprobs is not None, echo, include_usage)
        return await respond(request, model, job, reply, body.stream)
    replies = [CompletionReply(rid, job, tokenizer, body.logprobs is not None, echo, False, index=i)
               for i in range(job.n)]
    return await respond(request, model, job, Choices(replies, include_usage), body.stream)
