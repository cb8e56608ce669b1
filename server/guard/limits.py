"""What one request may ask for: every limit in one table, checked before any work starts.

Each limit is a setting (server/settings.py: flag, default, check and help together) of `Limits`,
which ServerConfig extends; docs/limits.md is the table for users. A request over a limit gets a
400 that names the limit and its flag, in the route's own error shape, before it is tokenized,
compiled or queued: the work a request can cost is bounded by what it is allowed to send.

Defaults sit where the API a route speaks puts its own (OpenAI: 4 stop strings, 128 tools, 300
logit_bias entries; Anthropic: 100,000 messages); where that API sets none, the default is
generous, since refusing what the real API accepts breaks its clients. A user may raise any of
them; the chat template is the one thing a client never supplies (server/text/template.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvfork.server.settings import at_least, between, setting
from kvfork.server.guard.errors import ApiError

KiB, MiB = 1024, 1024 * 1024
# The prompt-characters cap, when not set, is this many times the context length: far above the
# characters any tokenizer packs into one token, so a prompt just over the context still reaches the
# token count and gets its context-length error, while a 15 MB message is refused before tokenizing.
CHARS_PER_CONTEXT_TOKEN = 32
# Pillow refuses to open an image past this many pixels (twice its Image.MAX_IMAGE_PIXELS) as a bomb
PILLOW_MAX_PIXELS = 2 * (1024**3 // 4 // 3)


def _positive(v: Any) -> str | None:
    return None if v is None or v > 0 else f"must be > 0, got {v}"


@dataclass(frozen=True)
class Limits:
    SETTINGS_GROUP = "limits"

    max_body_bytes: int = setting(16 * MiB, "largest request body; bigger gets 413", check=at_least(1024),
                                  size=True)
    max_json_depth: int = setting(128, "deepest nesting of arrays and objects in a request body", check=at_least(8))
    max_messages: int = setting(100_000, "most messages in one chat, Messages or Responses request (Anthropic's "
                                "limit)", check=at_least(1))
    max_prompt_chars: int | None = setting(None, "most characters of messages and tools a request may send to be "
                                           f"rendered and tokenized (default: {CHARS_PER_CONTEXT_TOKEN} x the context "
                                           "length)", check=at_least(1))
    max_tools: int = setting(128, "most tools in a chat completions or Responses request (OpenAI's limit; "
                             "/v1/messages tools are bounded by --max-prompt-chars alone, as Anthropic sets no "
                             "count)", check=at_least(1))
    max_schema_bytes: int = setting(256 * KiB, "largest JSON schema a grammar is compiled from: a response_format "
                                    "schema, or the tools' parameters together under tool_choice",
                                    check=at_least(1024), size=True)
    max_stop: int = setting(4, "most stop strings on chat and completions (OpenAI's limit)", check=at_least(1))
    max_stop_sequences: int = setting(256, "most stop_sequences on /v1/messages (Anthropic sets no limit: a "
                                      "generous one)", check=at_least(1))
    max_stop_chars: int = setting(256, "longest stop string or stop sequence, in characters", check=at_least(1))
    max_n: int = setting(8, "most choices (n) a chat or completions request may ask for; each takes an "
                         "inference slot", check=at_least(1))
    max_logit_bias: int = setting(300, "most logit_bias entries (OpenAI's limit)", check=at_least(1))
    max_images: int = setting(100, "most images in one chat, Messages or Responses request, its history included "
                              "(Anthropic's limit)", check=at_least(0))
    max_image_pixels: int = setting(8000 * 8000, "most pixels (width x height) of one image, read from its header "
                                    "before any pixel is decoded (decompression bombs); Anthropic refuses past "
                                    "8000 x 8000", check=between(1, PILLOW_MAX_PIXELS))
    max_template_kwarg_chars: int = setting(1024, "longest string a chat_template_kwargs value may be",
                                            check=at_least(1))
    max_stored_responses: int = setting(1024, "responses each tenant keeps for previous_response_id "
                                        "(/v1/responses), its oldest out first", check=at_least(1))
    max_stored_response_bytes: int = setting(64 * MiB, "bytes of stored responses (their conversations "
                                             "included) each tenant keeps, its oldest out first",
                                             check=at_least(1024), size=True)
    grammar_compile_timeout: float = setting(5.0, "most seconds a request's grammar (response_format, "
                                             "tool_choice) may take to compile, in a process that is killed "
                                             "past it; the request then gets a 400, and its tenant's new grammars "
                                             "past 8 KiB a 429 for ten times this", check=at_least(0.001))
    template_timeout: float = setting(10.0, "most seconds a chat template may take to render one request's "
                                      "messages (on a worker thread, interrupted past it); the request then gets a "
                                      "400", check=at_least(0.001))
    header_timeout: float = setting(30.0, "seconds a connection has to send a request's headers, from its "
                                    "opening or the end of its previous request (an idle keep-alive "
                                    "connection is closed then too)", check=_positive)
    body_timeout: float = setting(60.0, "seconds a request has to send its whole body", check=_positive)
    write_timeout: float = setting(30.0, "seconds a response may wait for a client that reads nothing; past it "
                                   "the request is cancelled and the connection closed", check=_positive)

    def prompt_chars(self, context: int) -> int:
        return self.max_prompt_chars or CHARS_PER_CONTEXT_TOKEN * context


def over(param: str | None, what: str, limit: int | float, flag: str, code: str = "limit_exceeded") -> ApiError:
    """The refusal of a request over a limit: what it sent, the limit, and the flag that raises it. `code` is
    OpenAI's where it has one (array_above_max_length, string_above_max_length, integer_above_max_value)."""
    return ApiError(400, f"{what}; the limit is {limit:,} ({flag})", code=code, param=param)


# ---- the body ----

_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')  # every byte but these is dropped
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[list(b"[{")], _DEPTH_STEP[list(b"]}")] = 1, -1
_CHUNK = 1 << 20


def json_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether JSON `raw` nests arrays and objects more than `limit` deep, without decoding it.

    Escaped backslashes and quotes go first (left to right, as a JSON reader pairs them), then
    every byte but quotes and brackets; brackets inside strings (an odd count of quotes before
    them) do not count. numpy does the counting, a chunk at a time, stopping at the first chunk
    that goes too deep: a 16 MiB body costs a few tens of milliseconds. Invalid JSON may be
    miscounted; its decoder refuses it anyway.
    """
    s = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _STRUCTURE)
    depth, in_string = 0, 0
    for at in range(0, len(s), _CHUNK):
        chunk = np.frombuffer(s, np.uint8, count=min(_CHUNK, len(s) - at), offset=at)
        step = _DEPTH_STEP[chunk]
        quotes = chunk == ord('"')
        if in_string or quotes.any():
            inside = ((np.cumsum(quotes, dtype=np.int32) + in_string) & 1).astype(bool)
            step[inside] = 0
            in_string = int(inside[-1])
        levels = np.cumsum(step, dtype=np.int32)
        if depth + int(levels.max()) > limit:
            return True
        depth += int(levels[-1])
    return False


def check_depth(raw: bytes, limits: Limits) -> None:
    if json_deeper_than(raw, limits.max_json_depth):
        raise ApiError(400, f"the body nests arrays and objects more than {limits.max_json_depth} deep "
                       "(--max-json-depth)", code="limit_exceeded")


# ---- one request's fields ----


def check_count(param: str, items: Any, limit: int, flag: str, noun: str) -> None:
    if items is not None and len(items) > limit:
        raise over(param, f"{param} has {len(items):,} {noun}", limit, flag, "array_above_max_length")


def check_stops(param: str, stops: str | list[str] | None, count: int, count_flag: str, limits: Limits) -> None:
    """Stop strings: their count (the route's limit) and each one's length."""
    if stops is None:
        return
    listed = [stops] if isinstance(stops, str) else stops
    check_count(param, listed, count, count_flag, "strings")
    for i, stop in enumerate(listed):
        if len(stop) > limits.max_stop_chars:
            where = param if isinstance(stops, str) else f"{param}[{i}]"
            raise over(where, f"{where} is {len(stop):,} characters long", limits.max_stop_chars, "--max-stop-chars",
                       "string_above_max_length")


def check_sampling(body: Any, limits: Limits) -> None:
    """What chat and completions share (OpenAI's SamplingFields): n, stop, logit_bias."""
    if body.n > limits.max_n:
        raise over("n", f"n is {body.n}", limits.max_n, "--max-n", "integer_above_max_value")
    check_stops("stop", body.stop, limits.max_stop, "--max-stop", limits)
    check_count("logit_bias", body.logit_bias, limits.max_logit_bias, "--max-logit-bias", "entries")


def text_chars(value: Any) -> int:
    """Characters a decoded JSON value puts before the template: its strings as they are, anything else
    as its JSON (msgspec writes it at C speed)."""
    if isinstance(value, str):
        return len(value)
    if value is None:
        return 0
    return len(msgspec.json.encode(value))


def check_prompt_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, limits: Limits,
                       context: int) -> None:
    cap = limits.prompt_chars(context)
    total = text_chars(tools)
    for message in messages:
        total += sum(text_chars(v) for v in message.values())
        if total > cap:
            break
    if total > cap:
        flag = "--max-prompt-chars" if limits.max_prompt_chars else \
            f"{CHARS_PER_CONTEXT_TOKEN} x the context of {context:,} tokens, --max-prompt-chars"
        raise over("messages", f"the messages and tools hold more than {cap:,} characters", cap, flag)


def check_schema(param: str, schema: Any, limits: Limits) -> None:
    """A schema a grammar is compiled from (or several, as one grammar takes them): its JSON size."""
    size = len(msgspec.json.encode(schema))
    if size > limits.max_schema_bytes:
        raise over(param, f"the JSON schema of {param} is {size:,} bytes", limits.max_schema_bytes,
                   "--max-schema-bytes")
