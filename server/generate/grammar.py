"""Constrained decoding: what a request asks for, compiled into an llguidance grammar.

llguidance, not xgrammar (docs/agents.md says why; tools/grammar_bench.py
measures both): it compiles a schema in well under a millisecond, lazily, so a
fresh tool list per request costs nothing; its Lark dialect embeds JSON schemas
(`%json`) and lazy lexemes, which is what tool-call markup and `tool_choice:
auto` need.

What gets constrained (`Ask`, built by the routes):
- `response_format: json_object`: any JSON object; `json_schema`: JSON valid
  against the schema; `strict: true` refuses keywords llguidance cannot enforce
  (a 400), otherwise they are ignored (lenient);
- `tool_choice: required`: one or more calls among the tools (one with
  `parallel_tool_calls: false`), `function` (named):
  exactly one call to it, each call's arguments valid against its `parameters`,
  written in the markup of the request's tool-call family: each family's module
  in server/toolcalls/ writes one call (`call_grammar`), special tokens of the
  markup as token references (toolcalls/grammar_pieces.py);
- `tool_choice: auto`: a lazy grammar: text is free until the family's opening
  markup, then the call's body is constrained (llama3: a reply that opens with
  `{` is a call); only for models that write their markup as text
  (`auto_constrained`), and not Harmony, whose channels come and go.
When the route has already appended the parser's opening to the prompt (the
forced prefix, chat_output.py), the grammar starts after it.

Design rules:
- JSON is written compactly as the parsers and templates write it (`", "` and
  `": "`, no free whitespace): a small model cannot wander into endless blank
  lines, and a call re-renders to the text the model wrote;
- an object schema that does not say `additionalProperties` gets `false`, as in
  llama.cpp: a small model otherwise invents keys until it runs out of tokens;
- compiled grammars are cached by scope and grammar text, per tokenizer (one
  compiler per loaded tokenizer); each request gets a copy of the cached matcher;
- every matcher runs under llguidance's limits (PARSER_LIMITS), so no mask step
  is unbounded; a new grammar past GUARDED_TEXT is first built in a process
  killed past --grammar-compile-timeout (grammar_worker.py): past it, or on a bad
  schema, a 400 naming the problem; a tenant whose compile ran past it has its
  next new grammars past GUARDED_TEXT refused with a 429 for COOLDOWN_TIMEOUTS
  timeouts (Retry-After), so its compiles take a bounded share of a core;
- a schema is bounded before any of this: its size (--max-schema-bytes) and
  nesting (--max-json-depth), checked by the routes (server/guard/limits.py).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

from kvfork.server.engine.api import Scope
from kvfork.server.generate.grammar_worker import write_message
from kvfork.server.generate.isolated import module_command
from kvfork.server.generate.reasoning import FORMATS
from kvfork.server.guard.errors import ApiError
from kvfork.server.guard.fair_workers import FairWorkers
from kvfork.server.guard.refusals import PAUSE_S
from kvfork.server.toolcalls import PARSERS
from kvfork.server.toolcalls.grammar_pieces import JSON_OPTIONS, CallGrammar, closed, markup, text_until

ToolChoice = Literal["auto", "none", "required", "function"]
_CACHE_ENTRIES = 256


@dataclass(frozen=True)
class JsonObject:
    """response_format json_object: any JSON object."""


@dataclass(frozen=True)
class JsonSchema:
    schema: dict[str, Any]
    strict: bool = False


@dataclass(frozen=True)
class ToolCalls:
    parser: str  # a server/toolcalls parser name
    tools: tuple[dict[str, Any], ...]  # the request's `function` objects: name, parameters, strict
    choice: ToolChoice  # auto, required or function
    name: str | None = None  # the named function
    forced: str = ""  # the opening the prompt already ends with
    parallel: bool = True  # False: `required` makes exactly one call
    specials: Mapping[str, int] = field(default_factory=dict)  # the tokenizer's special tokens: text -> id


Ask = JsonObject | JsonSchema | ToolCalls


class GrammarError(ApiError):
    """A grammar the request asks for and that cannot be built: 400 naming the problem."""

    def __init__(self, param: str, message: str):
        super().__init__(400, message, code="invalid_grammar", param=param)


class CompileCooling(ApiError):
    """A tenant's new large grammar while it cools down from a compile past the timeout: 429, Retry-After."""

    def __init__(self, param: str, timeout_s: float, left_s: float):
        super().__init__(429, f"a grammar of this tenant took longer than {timeout_s:g} s to compile "
                         f"(--grammar-compile-timeout); its new grammars of more than {GUARDED_TEXT // 1024} KiB "
                         f"are refused for {left_s:.0f} s more", code="rate_limit_exceeded", param=param,
                         retry_after=left_s)


# ---- what each ask compiles to ----


def tool_lark(ask: ToolCalls) -> str:
    """The Lark grammar of the calls `ask` allows (see the module docstring). A family whose calls share a
    block (Kimi's section, MiniMax's `<minimax:tool_call>`) writes parallel calls inside one."""
    family = PARSERS.get(ask.parser)
    if family is None:
        raise GrammarError("tool_choice", f"tool calls in the {ask.parser!r} format cannot be constrained")
    functions = [f for f in ask.tools if ask.choice != "function" or f["name"] == ask.name]
    calls = [family.call_grammar(f, i, ask.specials) for i, f in enumerate(functions)]
    if not calls:
        raise GrammarError("tool_choice", "no tool to call")
    opening, closing = family.block
    firsts = [CallGrammar(opening + c.head, c.body, c.tail) for c in calls]  # a block's first call opens it
    rules = [rule for call in calls for rule in call.rules]
    every = " | ".join(f"({c.expression(ask.specials)})" for c in calls)
    many = ask.choice == "auto" or (ask.choice == "required" and ask.parallel)
    more = " ".join(p for p in ((f"({markup(family.separator, ask.specials)} call)*" if many else ""),
                                markup(closing, ask.specials)) if p)
    lines = ["%llguidance {}", f"call: {every}", "ANY_TEXT: /(.|\\n)*/"]
    if ask.choice == "auto" and family.trigger is None:  # llama3: the whole reply is calls, or text not opening `{`
        lines.append(f"start: call {more} | /([^{{](.|\\n)*)?/")
    elif ask.choice == "auto":
        bodies = " | ".join(f"({c.expression(ask.specials, family.trigger)})" for c in firsts)
        lines += ["start: (opening call_body)* ANY_TEXT", text_until("opening", family.trigger, ask.specials),
                  f"call_body: ({bodies}) {more}"]
    else:
        first = [e for c in firsts if (e := c.expression(ask.specials, ask.forced)) is not None]
        if not first:
            raise GrammarError("tool_choice", "the forced opening matches no tool")
        lines.append(f"start: ({' | '.join(f'({e})' for e in first)}) {more}")
    return "\n".join(lines + rules) + "\n"


def grammar_text(ask: Ask) -> str:
    """The llguidance grammar for an ask; raises GrammarError on one that cannot be written."""
    import llguidance

    match ask:
        case JsonObject():
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        case JsonSchema(schema, strict):
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(closed(schema), overrides={**JSON_OPTIONS,
                                                                                       "lenient": not strict})
            except ValueError as exc:
                raise GrammarError("response_format", f"the JSON schema is not valid: {exc}") from None
        case ToolCalls():
            return llguidance.LLMatcher.grammar_from_lark(tool_lark(ask))
    raise TypeError(ask)


def request_ask(response_format: Any, tool_parser: str | None, tools: list[dict[str, Any]] | None,
                choice: ToolChoice, tool_name: str | None, forced: str, parallel: bool = True,
                specials: Mapping[str, int] | None = None) -> Ask | None:
    """What a chat request asks its output to follow, or None. `response_format` is the protocol's
    ResponseFormat; `tool_parser` the parser the reply is read with (None: tools are not parsed);
    `forced` the opening the prompt ends with; `parallel` False (parallel_tool_calls) allows one call."""
    if response_format is not None and response_format.type != "text":
        match response_format.type:
            case "json_object":
                return JsonObject()
            case "json_schema":
                spec = response_format.json_schema
                if spec is None or not isinstance(spec.schema, dict):
                    raise GrammarError("response_format.json_schema.schema", "json_schema needs a schema (an object)")
                return JsonSchema(spec.schema, bool(spec.strict))
            case other:
                raise GrammarError("response_format.type",
                                   f"response_format is text, json_object or json_schema, got {other!r}")
    if tool_parser is None or not tools or choice == "none":
        return None
    if choice != "auto" and not forced:  # the reply starts inside reasoning: forced calls act as auto (chat_output)
        choice, tool_name = "auto", None
    if choice == "auto" and not auto_constrained(tool_parser, specials or {}):
        return None
    return ToolCalls(tool_parser, tuple(t["function"] for t in tools), choice, tool_name, forced, parallel,
                     dict(specials or {}))


def auto_constrained(tool_parser: str, specials: Mapping[str, int]) -> bool:
    """Whether tool_choice auto gets a grammar: only where the model writes its markup as text. Free text
    is a lexeme, which never holds a special token: where the call or thinking markers are special tokens
    (Kimi's, GLM's in their own tokenizers) a free-text grammar would forbid them, so the calls the model
    opens are parsed but not held (a broken one comes back as content)."""
    family = PARSERS[tool_parser]
    markers = (*family.special_markers, *(m for f in FORMATS.values() for m in (f.open, f.close)))
    return family.constrains_auto and not any(s in m for s in specials for m in markers)


def param_of(ask: Ask) -> str:
    return "tool_choice" if isinstance(ask, ToolCalls) else "response_format"


# ---- matchers (server/engine/worker/constraints.py's protocols) ----


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any):
        self._m = matcher

    def advance(self, token: int) -> None:
        self._m.consume_token(token)  # a refused token leaves the matcher in error: fill_mask reports it

    def fill_mask(self, out: np.ndarray) -> str | None:
        if self._m.is_error():
            return self._m.get_error()
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._m.is_error():
            return self._m.get_error()
        return None if out.any() else "no token fits the grammar here"

    def fork(self) -> "Matcher":
        return Matcher(self._m.deep_copy())

    def validate(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts from here; the matcher is unchanged (drafts)."""
        return self._m.validate_tokens(tokens)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: every request under it gets a copy of the ready matcher."""

    _template: Any

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy())


# llguidance's own bounds on the work of one grammar (its defaults, stated here so the bound is ours): a mask
# step costs at most a few tens of milliseconds, a lexer or a grammar cannot grow without bound, and errors
# never carry grammar state (verbose errors would put the grammar, another request's schema, in the text).
PARSER_LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                     step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
                     verbose_errors=False)
COMPILE_THREADS = 2  # a tenant compiles one grammar at a time: with two, another tenant always finds one free
# Grammars longer than this (characters of grammar text) are tried in the killable process first. Below it the
# build is bounded by the size: what grows faster than a schema is objects of hundreds of optional properties,
# and 8 KiB of grammar holds about 330 (600 of them, 15 KiB of grammar, build in 28 ms on a quiet 2-core
# machine: docs/benchmarks.md, "The grammar guard"); the
# typical tool schema is a few hundred characters and builds in a millisecond, where the round trip to the
# process would cost twenty.
GUARDED_TEXT = 8 * 1024
# After a tenant's compile runs past the timeout, its new grammars past GUARDED_TEXT are refused for this many
# timeouts: compiles past the timeout take at most 1/(1 + COOLDOWN_TIMEOUTS) of a core per tenant (and run at
# the lowest priority: grammar_worker.NICENESS). A schema that compiles in time is never refused.
COOLDOWN_TIMEOUTS = 10


def _parser_limits() -> Any:
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)


class CompileProcess:
    """One worker thread's grammar_worker.py process: started on first use, killed past the timeout."""

    def __init__(self, setup: Callable[[], dict[str, Any]], env: Mapping[str, str]):
        self._setup, self._env = setup, env
        self._proc: subprocess.Popen | None = None

    def check(self, grammar: str, timeout_s: float) -> str | None:
        """Build `grammar` in the process: why it cannot be built, or None. TimeoutError past `timeout_s`
        (the process is killed); a process that dies gives its grammar's error."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        try:
            write_message(self._proc.stdin, {"grammar": grammar})
            reply = self._reply(timeout_s)
        except TimeoutError:
            self.close()
            raise
        except (OSError, EOFError, ValueError):
            self.close()
            return "the grammar compiler stopped on this grammar"
        return reply["error"]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    stream.close()
            self._proc = None

    def _start(self) -> None:
        self._proc = subprocess.Popen(module_command("kvfork.server.generate.grammar_worker"), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=dict(self._env))
        assert self._proc.stdin is not None
        write_message(self._proc.stdin, self._setup())
        self._reply(STARTUP_S)

    def _reply(self, timeout_s: float) -> Any:
        assert self._proc is not None and self._proc.stdout is not None
        fd, deadline, data = self._proc.stdout.fileno(), time.monotonic() + timeout_s, b""
        size = None
        while size is None or len(data) < 4 + size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            data += chunk
            if size is None and len(data) >= 4:
                (size,) = struct.unpack("<I", data[:4])
        return json.loads(data[4:])


STARTUP_S = 120.0  # a compile process's start (building the tokenizer's view) is not a grammar's cost


class GrammarCompiler:
    """Compiles asks against one tokenizer, caching what each scope compiled.

    The cache is keyed by scope (tenant and cache_salt) as every other cache is: a grammar another
    tenant compiled would otherwise come back in 0.15 s instead of 2, telling which schemas it uses.
    Compiles run on worker threads shared by tenants in turn (server/guard/fair_workers.py), each trying a new grammar
    past GUARDED_TEXT first in its own process that is killed past the timeout (CompileProcess); a tenant whose
    compile was killed cools down (COOLDOWN_TIMEOUTS) before its next one there. `child_env`: the compile
    processes' environment, which the caller clears of the daemon's secrets (settings.without_secrets)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], timeout_s: float,
                 child_env: Mapping[str, str]):
        self._hf, self.vocab_size, self.eos_ids, self.timeout_s = hf_tokenizer, vocab_size, list(eos_ids), timeout_s
        self._child_env = child_env
        self._tokenizer: Any = None
        self._tokenizer_json: str | None = None
        self._tokenizer_lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[Scope, str], Grammar] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._cooling: dict[str, float] = {}  # tenant -> when (monotonic) its new large grammars are tried again
        self._workers = FairWorkers(COMPILE_THREADS, "kvfork-grammar", lambda: CompileProcess(self.setup, self._child_env))

    def tokenizer(self) -> Any:
        """The llguidance view of the tokenizer: built once, on first use (about a second)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance

                backend = copy.copy(self._hf.backend_tokenizer)  # as llguidance.hf does: no padding, no truncation
                backend.no_padding()
                backend.no_truncation()
                self._tokenizer_json = backend.to_str()
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_ids)
            return self._tokenizer

    def setup(self) -> dict[str, Any]:
        """The compile process's first message (grammar_worker.py)."""
        self.tokenizer()
        return {"tokenizer": self._tokenizer_json, "vocab_size": self.vocab_size, "eos": self.eos_ids,
                "limits": {k: v for k, v in PARSER_LIMITS.items()}}

    async def compile(self, ask: Ask, scope: Scope = Scope()) -> Grammar:
        """`ask`'s grammar for a request of `scope`: from its scope's cache, or compiled (GrammarError: 400)."""
        try:
            return await self._workers.run(scope.tenant, self._compile, ask, scope)
        except CompileCooling:
            await asyncio.sleep(PAUSE_S)  # as refusals past --refusal-rate: a client sending them fast is slowed
            raise

    def close(self) -> None:
        self._workers.close()

    def _compile(self, process: CompileProcess, ask: Ask, scope: Scope) -> Grammar:
        text = grammar_text(ask)
        key = scope, text
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        param = param_of(ask)
        if len(text) > GUARDED_TEXT:
            left_s = self._cooldown_left(scope.tenant)
            if left_s > 0:
                raise CompileCooling(param, self.timeout_s, left_s)
            try:
                error = process.check(text, self.timeout_s)
            except TimeoutError:
                self._cool(scope.tenant)
                raise GrammarError(param, f"the grammar took longer than {self.timeout_s:g} s to compile "
                                   "(--grammar-compile-timeout); simplify the schema") from None
            if error:
                raise GrammarError(param, f"the grammar cannot be compiled: {error}")
        grammar = self.build(text, param)
        with self._cache_lock:
            self._cache[key] = grammar
            if len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return grammar

    def _cooldown_left(self, tenant: str) -> float:
        with self._cache_lock:
            return self._cooling.get(tenant, 0.0) - time.monotonic()

    def _cool(self, tenant: str) -> None:
        now = time.monotonic()
        with self._cache_lock:
            self._cooling = {t: until for t, until in self._cooling.items() if until > now}  # the cooled drop out
            self._cooling[tenant] = now + COOLDOWN_TIMEOUTS * self.timeout_s

    def build(self, text: str, param: str) -> Grammar:
        """Grammar `text` built on the calling thread: no process, no cache (what `compile` does once it
        knows the grammar builds in time)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0, limits=_parser_limits())
        mask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        if not matcher.is_error():  # the first mask builds the lexer: the expensive part
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error():
            raise GrammarError(param, f"the grammar cannot be compiled: {matcher.get_error()}")
        return Grammar(matcher)
