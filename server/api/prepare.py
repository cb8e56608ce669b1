"""The one preparation every API route calls: a request body -> a `Job` (prompt tokens, the
engine request, stop strings, the output parser).

A chat request is first checked (`check_chat`: every limit that needs no loaded model), before the route
acquires its model, so a refused request never loads or unloads one; `prepare` is then the one path
from a checked request to prompt tokens and an output parser: template, tokens (`render_prompt`, which
count_tokens calls alone), sampling, grammar. The Anthropic and Responses routes
translate their bodies into a chat request and take the same path, so every API
gets the same tokens and reuse. Tools: checking tools and tool_choice, feeding
past calls back to templates (or, for templates that render no tools, the Hermes
block: toolcalls/hermes.py).

A body's sampling fields become the engine's `GenerateRequest` (`generate_request`,
below); the completions route, whose prompt is text or token ids with no template,
calls it and its neighbours directly.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from aiohttp import web

from kvfork.backends.base import SEEDS, SamplingParams
from kvfork.backends.vision import ImageInput
from kvfork.server.api.chat.protocol import ChatCompletionRequest, ChatMessage
from kvfork.server.api.diagnosis import FINGERPRINTS, Asked, Fingerprint, Fingerprints, Report, fingerprint
from kvfork.server.api.images import IMAGE_PART, read_images
from kvfork.server.api.openai import SamplingFields
from kvfork.server.api.respond import Job
from kvfork.server.api.vision import SeenImage, image_mark, vision_prompt
from kvfork.server.common.config import ServerConfig
from kvfork.server.common.state import ModelBounds, ModelState, Services, scope_of, tenant_of
from kvfork.server.engine.api import GenerateRequest, Scope
from kvfork.server.engine.cache.sessions import check_session_id
from kvfork.server.generate.chat_output import ChatOutputParser, ModelFormats
from kvfork.server.generate.grammar import request_ask
from kvfork.server.guard.errors import ApiError, invalid, client_text
from kvfork.server.guard.limits import check_count, check_prompt_chars, check_schema, json_deeper_than
from kvfork.server.text.tokenizer import PromptTokenizer
from kvfork.server.toolcalls.base import openai_call_id
from kvfork.server.toolcalls.hermes import with_tools_block


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


def template_tool_calls(calls: list[dict[str, Any]], max_depth: int) -> list[dict[str, Any]]:
    """Calls as templates read them: JSON-object arguments as objects.

    OpenAI clients send arguments as JSON text, but many templates render them
    with `tojson` (Llama 3, Qwen2.5): text would come out quoted twice. Arguments
    nested deeper than the body may be (--max-json-depth) stay text.
    """
    out = []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            text = function["arguments"]
            try:
                arguments = None if json_deeper_than(text.encode(), max_depth) else json.loads(text)
            except (ValueError, UnicodeEncodeError):
                arguments = None
            if isinstance(arguments, dict):
                call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


def template_message(index: int, message: ChatMessage, max_depth: int,
                     images: Mapping[tuple[int, int], str | SeenImage]) -> dict[str, Any]:
    """A message as chat templates expect it: text content (each image as its line for a text-only model:
    server/api/images.py; as its mark for a model that reads it: server/api/vision.py), the other fields
    passed through."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type == IMAGE_PART:
                image = images[index, j]
                texts.append(image if isinstance(image, str) else image_mark(image))
            elif part.type == "text":
                texts.append(part.text or "")
            else:
                raise ApiError(400, f"content parts of type {client_text(part.type, 32)} are not supported; send "
                               "text or images", code="unsupported_content", param=f"messages[{index}].content[{j}]")
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    if message.reasoning_content is not None:  # gpt-oss's template reads it as `thinking`
        out["thinking"] = message.reasoning_content
    if message.tool_calls is not None:
        out["tool_calls"] = template_tool_calls(message.tool_calls, max_depth)
    return out


@dataclass
class Checked:
    """A chat-shaped request checked against every limit that needs no loaded model, before any model is
    acquired (a refused request never loads one): its messages as templates read them, its tool choice, its
    session."""

    body: ChatCompletionRequest
    messages: list[dict[str, Any]]
    choice: str  # auto | none | required | function
    tool_name: str | None  # the function a named tool_choice names
    session: str | None
    context: int | None  # the context its characters were checked for (None: not yet)
    images: list[SeenImage]  # for a model that reads them, in the messages' order


async def check_chat(services: Services, body: ChatCompletionRequest, request: web.Request, rid: str,
                     known: ModelBounds | None = None) -> Checked:
    """Chat, Messages and Responses requests alike: what a body may ask for, judged from the body, the limits
    and the model's context and vocabulary where they are known before the model is acquired (Models.known),
    its images read (each a line of text for a text-only model: server/api/images.py). The route has checked
    its own API's limits (stop strings, tools) before translating it."""
    config = services.config
    if body.top_logprobs and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    if known is not None and known.vocab_size is not None:
        token_ids(body, known.vocab_size)
    check_count("messages", body.messages, config.max_messages, "--max-messages", "messages")
    images = await read_images(services, body.messages, body.model, tenant_of(request), rid,
                               services.models.reads_images(body.model))
    messages = [template_message(i, m, config.max_json_depth, images) for i, m in enumerate(body.messages)]
    context = known.context if known is not None else None
    if context is not None:
        check_prompt_chars(messages, body.tools, config, context)
    choice, tool_name = tool_choice_of(body.tool_choice, check_tools(body.tools))
    if body.response_format is not None and body.response_format.json_schema is not None:
        check_schema("response_format", body.response_format.json_schema.schema, config)
    if body.tools and body.tool_choice != "none":  # a tool grammar is built from their parameters
        check_schema("tools", [tool["function"].get("parameters") for tool in body.tools], config)
    session = session_id(body.session_id, request.headers, config.session_header)
    seen = [image for _, image in sorted(images.items()) if isinstance(image, SeenImage)]
    return Checked(body, messages, choice, tool_name, session, context, seen)


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


@dataclass
class Rendered:
    """A checked request's prompt: its tokens, the parser of its output, and what the template was given."""

    prompt: list[int]
    parser: ChatOutputParser
    messages: list[dict[str, Any]]  # as rendered (system messages inlined where the template wants them)
    template_input: tuple[list[dict[str, Any]], list[dict[str, Any]] | None]  # messages and tools (Hermes block)
    kwargs: dict[str, Any]  # the template's own variables
    images: tuple[ImageInput, ...] = ()  # the images its prompt's keys name (a model that reads them)


async def render_prompt(tokenizer: PromptTokenizer, formats: ModelFormats, config: ServerConfig, checked: Checked,
                        context: int, tenant: str, make_call_id: Callable[[], str] = openai_call_id,
                        count_all: bool = False) -> Rendered:
    """Template and tokens: the prompt a checked request takes on a model of `context` tokens and `formats`
    (its tokenizer's, resolved at its load). A long prompt that
    cannot fit is refused on its prefix (ContextTooLong: PromptTokenizer.within) unless `count_all` (count_tokens
    counts every token, past the context too)."""
    body, messages = checked.body, checked.messages
    if checked.context != context:
        check_prompt_chars(messages, body.tools, config, context)
    kwargs = tokenizer.variables.kwargs(body.chat_template_kwargs, config.max_template_kwarg_chars)
    try:
        text = await tokenizer.render_chat(messages, body.tools, kwargs, tenant)
    except ApiError:
        inlined = inline_system_messages(messages)
        if inlined == messages:
            raise
        messages = inlined
        text = await tokenizer.render_chat(messages, body.tools, kwargs, tenant)
    rendered = messages, body.tools
    if body.tools and config.tool_parser == "auto" and formats.tool is None:
        # A template that teaches no tool format may still render tools its own way; only one that
        # renders none at all (the text is the same without them) gets the Hermes block.
        if text == await tokenizer.render_chat(messages, None, kwargs, tenant):
            rendered = with_tools_block(messages, body.tools), None
            text = await tokenizer.render_chat(*rendered, kwargs, tenant)
            formats = replace(formats, tool="hermes")
    parser = formats.parser(text, body.tools, checked.choice, checked.tool_name, make_call_id)
    images: tuple[ImageInput, ...] = ()
    if checked.images:
        prompt, images = await vision_prompt(tokenizer, text, checked.images, tenant)
    else:
        prompt = await tokenizer.encode_rendered(text, tenant, None if count_all else context)
    if parser.prompt_suffix:  # encoded on its own: the prompt before it keeps the tokens other turns share
        prompt += await tokenizer.encode_rendered(parser.prompt_suffix, tenant)
    return Rendered(prompt, parser, messages, rendered, kwargs, images)


async def prepare(model: ModelState, checked: Checked, request: web.Request, rid: str,
                  make_call_id: Callable[[], str] = openai_call_id, asked: Asked | None = None) -> Job:
    """A checked request on its model: render, tokenize, sampling, grammar."""
    body = checked.body
    tokenizer = model.require_ready()
    name = model.model_name(body.model)
    scope = scope_of(request, body.cache_salt)
    tenant = scope.tenant
    rendered = await render_prompt(tokenizer, model.require_formats(), model.config, checked, model.context, tenant,
                                   make_call_id)
    prompt, parser = rendered.prompt, rendered.parser
    generate = generate_request(
        body, prompt, rid=rid, vocab_size=model.info.vocab_size,
        max_tokens=body.max_completion_tokens or body.max_tokens, session=checked.session,
        scope=scope, logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0,
    )
    generate.images = rendered.images
    ask = request_ask(body.response_format, parser.call_format, body.tools,
                      checked.choice, checked.tool_name, parser.prompt_suffix,  # type: ignore[arg-type]
                      parallel=body.parallel_tool_calls is not False, specials=tokenizer.specials)
    if ask is not None:
        generate.constraint = await model.grammars().compile(ask, scope)
    checkpoints = model.engine.recurrent_checkpoints
    if checkpoints:  # a hybrid model keeps its recurrent state where messages end: find them
        generate.boundaries = await tokenizer.message_ends(*rendered.template_input, rendered.kwargs, prompt,
                                                           checkpoints, tenant)
    job = Job(name, prompt, generate, stop_strings(body), parser, body.n)
    if asked is not None:
        job.diagnostics = diagnostics(request.app[FINGERPRINTS], model.engine.config.prefix_cache_min_tokens, asked,
                                      await fingerprint(tokenizer, scope, name, rendered.messages, body.tools,
                                                        rendered.kwargs, prompt, checked.images))
    return job


def diagnostics(fingerprints: Fingerprints, min_tokens: int, asked: Asked, now: Fingerprint) -> Report:
    """The request's diagnostics report: compared with the response it names; its fingerprint is kept once the
    engine admits the request (respond)."""
    report = Report(fingerprints, min_tokens, now)
    if asked.previous is not None:
        report.diagnosis = fingerprints.compare(now, asked.previous)
    return report


# ---- the engine request: its id, named session, stop strings and sampling -----------------------
# Defaults follow OpenAI (temperature 1, top_p 1); `max_tokens` left out (None)
# takes the engine's `--max-tokens` when the operator set one, else the context
# left; the engine clamps any limit to the context left.

def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# kvfork's own session header. Sessions are opt-in: a header some client sends for its own purposes
# (opencode's x-session-id) names a session only when the operator maps it (--session-header).
SESSION_HEADER = "X-Kvfork-Session"


def session_id(body_value: str | None, headers: Mapping[str, str] | None = None,
               mapped: Sequence[str] = ()) -> str | None:
    """The named session a request opts into: the body's `session_id`, else the X-Kvfork-Session
    header, else the first of the operator's `--session-header` names it carries. Printable ASCII,
    at most 128."""
    value = body_value
    for name in (SESSION_HEADER, *mapped):
        if value is None and headers is not None:
            value = headers.get(name)
    if value is not None:
        try:
            check_session_id(value)
        except ValueError as e:
            raise invalid("session_id", str(e)) from None
    return value


def stop_strings(body: SamplingFields) -> list[str]:
    if body.stop is None:
        return []
    return [body.stop] if isinstance(body.stop, str) else list(body.stop)


def token_id(key: str, vocab_size: int) -> int | None:
    """A logit_bias key as the token id it names: ASCII digits only (int() takes "²", "-5", " 5" and
    raises past 4,300 digits), or None."""
    if not (key.isascii() and key.isdigit()) or len(key) > len(str(vocab_size)):
        return None
    token = int(key)
    return token if token < vocab_size else None


def token_ids(body: SamplingFields, vocab_size: int) -> tuple[dict[int, float], frozenset[int]]:
    """The body's logit_bias by token id, and its stop_token_ids, each an id of a vocabulary of `vocab_size`; a
    400 naming the field else. Checked before the model is acquired where its vocabulary is known
    (check_chat, the completions route), and again on the loaded model's (generate_request)."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        token = token_id(key, vocab_size)
        if token is None:
            raise invalid("logit_bias", f"logit_bias keys are token ids in [0, {vocab_size}), got "
                          f"{client_text(key, 32)}")
        bias[token] = value
    stop_ids = frozenset(body.stop_token_ids or ())
    if any(t >= vocab_size for t in stop_ids):
        raise invalid("stop_token_ids", f"stop_token_ids are token ids in [0, {vocab_size})")
    return bias, stop_ids


def generate_request(body: SamplingFields, prompt: list[int], *, rid: str, vocab_size: int, max_tokens: int | None,
                     session: str | None, scope: Scope = Scope(), logprobs: bool = False,
                     top_logprobs: int = 0) -> GenerateRequest:
    bias, stop_ids = token_ids(body, vocab_size)
    if body.seed is not None and body.seed not in SEEDS:
        raise invalid("seed", f"seed is a signed or unsigned 64-bit integer, in [-2**63, 2**64), got {body.seed}")
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),  # -1 (vLLM's "off") and 0 both mean off
        min_p=body.min_p or 0.0,
        seed=body.seed,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    return GenerateRequest(
        request_id=rid,
        prompt=prompt,
        sampling=sampling,
        max_tokens=max_tokens,  # type: ignore[arg-type]  # None: the engine's default
        stop_token_ids=stop_ids,
        ignore_eos=body.ignore_eos,
        session_id=session,
        scope=scope,
        n=body.n,
    )
