"""The model's tokenizer and chat template, kept off the event loop when the work is long.

BOS rule: a chat template that wants a BOS writes it, so rendered chat text is
encoded without special tokens; raw completion text gets the tokenizer's usual
special tokens unless it already starts with the BOS string. Either way a
prompt never carries two.

A chat template render, whatever its input's size, runs on a worker thread with a time limit
(`render_timeout`, --template-timeout): a template is code (a model's, a GGUF's from the hub, the
operator's), and a loop in it would hold the loop; past the limit the render is interrupted
(`interruptible`) and the request gets a 400. Encoding alone is bounded by its size, and short text
stays on the loop.

A prompt that cannot fit the context is refused without encoding it whole: text of more than
`PREFIX_CHARS_PER_TOKEN` characters per context token first has that many characters encoded, and when
they alone pass the context the request is refused there (ContextTooLong: "at least N tokens"). A
tokenizer splits text into pieces (words, runs of spaces) and merges within a piece, so cutting the text
changes only the tokens near the cut: those of the prefix's last `CUT_REACH_CHARS` characters are not
counted, and N is a lower bound of the whole prompt's tokens. A prompt just under --max-prompt-chars
(32 characters a context token) is refused for an eighth of its encoding (261,000 characters on the
default model: 21 ms of CPU instead of 136 ms, its render included); one that fits is encoded once, as
before, unless it is longer than 4 characters a context token and packs more than 4 into a token.

Long work (a render, or text past a few thousand characters to encode) runs on two worker threads
shared by tenants in turn, a tenant one job at a time (server/guard/fair_workers.py): the
routes pass the tenant, so another tenant never waits for the first one's long
job. Each thread renders and encodes with its own copy of the tokenizer (a Rust
tokenizer is not meant to be used by two threads at once). A job's size is
bounded before it gets here (server/guard/limits.py: characters, messages), and the
template is the model's or the operator's, never a client's (text/template.py).
Every method that does the work takes `tok`: the thread's copy, or (on the loop)
the tokenizer itself.
"""

from __future__ import annotations

import copy
import ctypes
import threading
from typing import Any, Callable, Sequence

from kvfork.server.engine.api import ContextTooLong
from kvfork.server.guard.errors import ApiError
from kvfork.server.guard.fair_workers import FairWorkers
from kvfork.server.guard.limits import Limits
from kvfork.server.text.template import TemplateVariables

# Prompts longer than this (characters) are tokenized on the worker thread: a
# few thousand characters take well under a millisecond, so shorter ones stay
# on the loop and skip the thread hop.
_OFF_LOOP_CHARS = 4096
# Text longer than this many characters per token of the context is counted on a prefix of that length first:
# about what prose packs into a token (code and agent histories about 3.5), so a prompt that fits is encoded
# once, and the refusal of a long one costs little more than the characters that pass the context.
PREFIX_CHARS_PER_TOKEN = 4
CUT_REACH_CHARS = 256  # a prefix's tokens this near its cut may differ from the whole text's: not counted
TOKENIZE_THREADS = 2  # a tenant runs one job at a time: with two, another tenant always finds one free


class RenderTimeout(BaseException):
    """Raised into a worker thread whose render ran past its limit: a BaseException, so that no `except
    Exception` of jinja's or transformers' takes it for a template's own error."""


def interruptible(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on this thread, RenderTimeout raised into it once `seconds` have passed (CPython's
    PyThreadState_SetAsyncExc: delivered at the next bytecode, which a template's loops run)."""
    thread = ctypes.c_ulong(threading.get_ident())
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def interrupt() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(thread, ctypes.py_object(RenderTimeout))

    timer = threading.Timer(seconds, interrupt)
    timer.start()
    try:
        return fn(*args)
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["fired"]:  # one not yet delivered is dropped: nothing after this may receive it
                ctypes.pythonapi.PyThreadState_SetAsyncExc(thread, None)


class PromptTokenizer:
    def __init__(self, tokenizer: Any, chat_template: str | None = None,
                 render_timeout: float = Limits.template_timeout):
        """`chat_template`: the operator's template (--chat-template), instead of the model's; `render_timeout`:
        the seconds a render may take (--template-timeout)."""
        self.tokenizer = tokenizer
        self.render_timeout = render_timeout
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        self.bos_token: str | None = tokenizer.bos_token
        self.variables = TemplateVariables.of(tokenizer.chat_template, frozenset(tokenizer.special_tokens_map))
        self.workers = FairWorkers(TOKENIZE_THREADS, "kvfork-tokenize", lambda: _Own(copy.deepcopy(tokenizer)))
        self._token_texts: dict[int, str] = {}
        added = getattr(tokenizer, "added_tokens_decoder", {})
        # The added tokens' texts: some tool-call and thinking formats are told by them (Kimi K3's XTML).
        self.vocabulary = frozenset(t.content for t in added.values())
        # Special tokens, text -> id: a grammar refers to markup tokens by id (server/toolcalls/grammar_pieces.py).
        self.specials = {t.content: i for i, t in added.items() if t.special}
        self._hidden: frozenset[int] | None = None  # special ids decode drops when some are kept
        named = getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type")
        self.tool_parser_type = named if isinstance(named, str) else None  # mlx-lm's key, set by MLX conversions
        self.vision: Any = None  # a model that reads images: its family's ImageProcessing (backends/vision)
        # A template that reads a message's content only as a list of parts (vision models' templates, as
        # SmolVLM's): each message's text is given to it as one text part. Probed once, within the render limit.
        try:
            self.content_as_parts = interruptible(render_timeout, _reads_parts_only, tokenizer)
        except RenderTimeout:
            self.content_as_parts = False

    def keep_special(self, texts: Sequence[str]) -> None:
        """Keep the special tokens among `texts` in `decode_markup`'s text (the markup of the model's
        tool-call and thinking formats: Harmony's `<|channel|>`, Kimi's `<|tool_call_begin|>`), dropping
        the others as `decode` does; the output parsers read the markup and no client sees it."""
        kept = {self.specials[t] for t in texts if t in self.specials}
        if kept:
            self._hidden = frozenset(set(self.specials.values()) | set(self.tokenizer.all_special_ids)) - kept

    @classmethod
    def load(cls, folder: str, chat_template: str | None = None,
             render_timeout: float = Limits.template_timeout) -> "PromptTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(folder), chat_template, render_timeout)

    def close(self) -> None:
        self.workers.close()

    @property
    def chat_template(self) -> str:
        """The template text (all of a model's named templates), for choosing the output parsers."""
        return str(self.tokenizer.chat_template or "")

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                   template_kwargs: dict[str, Any] | None = None, tenant: str = "") -> list[int]:
        return await self._render(tenant, self.encode_chat, messages, tools, template_kwargs or {})

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                          template_kwargs: dict[str, Any] | None = None, tenant: str = "") -> str:
        return await self._render(tenant, self.render, messages, tools, template_kwargs or {})

    async def message_ends(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                           template_kwargs: dict[str, Any] | None, prompt: Sequence[int], last: int,
                           tenant: str = "") -> tuple[int, ...]:
        """Token offsets in `prompt` (these messages rendered and encoded) where each of the last
        `last` earlier messages ends, the system/tools block included (GenerateRequest.boundaries)."""
        return await self._render(tenant, self.find_message_ends, messages, tools, template_kwargs or {}, prompt,
                                  last)

    def find_message_ends(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                          template_kwargs: dict[str, Any], prompt: Sequence[int], last: int,
                          tok: Any = None) -> tuple[int, ...]:
        # A message ends where the conversation cut after it, rendered without a generation prompt,
        # encodes to a prefix of the prompt. A template that renders a cut differently (one that
        # drops earlier turns' reasoning, say) or refuses it (no user turn yet) marks no end there.
        kwargs = self._variables(template_kwargs)
        ends: set[int] = set()
        for cut in range(len(messages) - 1, 0, -1):
            if len(ends) >= last:
                break
            try:
                text = (tok or self.tokenizer).apply_chat_template(self._shaped(messages[:cut]), tools=tools,
                                                                   add_generation_prompt=False, tokenize=False,
                                                                   **kwargs)
            except Exception:
                continue
            ids = self.encode_rendered_text(text, tok)
            if 0 < len(ids) < len(prompt) and list(prompt[:len(ids)]) == ids:
                ends.add(len(ids))
        return tuple(sorted(ends))

    async def encode_rendered(self, text: str, tenant: str = "", context: int | None = None) -> list[int]:
        """Rendered chat text (or a piece of it) as ids, special tokens as the text writes them; with `context`,
        a text that cannot fit it may be refused on its prefix (`within`)."""
        return await self._run(tenant, len(text), self.within, self.encode_rendered_text, text, context)

    async def text(self, text: str, tenant: str = "", context: int | None = None) -> list[int]:
        return await self._run(tenant, len(text), self.within, self.encode_text, text, context)

    def within(self, encode: Callable[..., list[int]], text: str, context: int | None, tok: Any = None) -> list[int]:
        """`encode(text)`; ContextTooLong, counted on a prefix, when the text is over PREFIX_CHARS_PER_TOKEN
        characters per token of `context` and its first that many characters alone pass the context."""
        if context is not None and len(text) > PREFIX_CHARS_PER_TOKEN * context:
            head = text[:PREFIX_CHARS_PER_TOKEN * context]
            counted = len(encode(head, tok)) - len(encode(head[-CUT_REACH_CHARS:], tok))
            if counted >= context:
                raise ContextTooLong(counted, context, counted=False)
        return encode(text, tok)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                    template_kwargs: dict[str, Any], tok: Any = None) -> list[int]:
        return self.encode_rendered_text(self.render(messages, tools, template_kwargs, tok), tok)

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None,
               template_kwargs: dict[str, Any], tok: Any = None) -> str:
        kwargs = self._variables(template_kwargs)
        try:
            rendered = (tok or self.tokenizer).apply_chat_template(
                self._shaped(messages), tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as e:  # jinja raises its own errors for histories a template rejects
            raise ApiError(400, f"the chat template rejected the messages: {e}", code="invalid_value",
                           param="messages") from None
        return rendered

    def _shaped(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the template reads them (`content_as_parts`)."""
        if not self.content_as_parts:
            return messages
        return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                else m for m in messages]

    def _variables(self, template_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The template's own variables among `template_kwargs` (the routes have refused the rest with a 400:
        text/template.py); nothing else ever reaches apply_chat_template."""
        return {k: v for k, v in template_kwargs.items() if k in self.variables.settable}

    def encode_rendered_text(self, text: str, tok: Any = None) -> list[int]:
        return (tok or self.tokenizer).encode(text, add_special_tokens=False)

    def encode_text(self, text: str, tok: Any = None) -> list[int]:
        starts_with_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return (tok or self.tokenizer).encode(text, add_special_tokens=not starts_with_bos)

    def decode(self, tokens: Sequence[int]) -> str:
        # No clean-up: it rewrites text already streamed (" ." -> "."), which
        # would break the incremental detokenizer's prefix rule.
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def decode_markup(self, tokens: Sequence[int]) -> str:
        """`decode`, with the special tokens `keep_special` named kept: the text the output parsers read."""
        if self._hidden is None:
            return self.decode(tokens)
        return self.tokenizer.decode([t for t in tokens if t not in self._hidden], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def token_text(self, token: int) -> str:
        """One token's own text, for logprobs (special tokens included); kept once decoded (a stream of 8
        choices with 20 top logprobs asks for 168 a step, and the vocabulary bounds the table)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False,
                                                                    clean_up_tokenization_spaces=False)
        return text

    async def _run(self, tenant: str, size: int, fn, *args):
        if size <= _OFF_LOOP_CHARS:
            return fn(*args)
        return await self.workers.run(tenant, lambda own: fn(*args, tok=own.tokenizer))

    async def _render(self, tenant: str, fn, *args):
        """A job that renders the template: on a worker, whatever its size, within `render_timeout`."""
        try:
            return await self.workers.run(tenant, lambda own: interruptible(self.render_timeout, fn, *args,
                                                                             own.tokenizer))
        except RenderTimeout:
            raise ApiError(400, f"the chat template took more than {self.render_timeout:g} s to render these "
                           "messages (--template-timeout)", code="template_timeout", param="messages") from None


def _reads_parts_only(tokenizer: Any) -> bool:
    """Whether the chat template drops a message's text given as a string, and renders it given as a list of
    one text part."""
    probe = "kvfork-probe-text"

    def renders(content: Any) -> bool:
        try:
            return probe in tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                          add_generation_prompt=True)
        except Exception:
            return False

    return bool(tokenizer.chat_template) and not renders(probe) and renders([{"type": "text", "text": probe}])


class _Own:
    """A worker thread's own copy of the tokenizer (FairWorkers' per-thread resource)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def close(self) -> None:
        pass
