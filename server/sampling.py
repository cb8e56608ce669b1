"""From a request body's sampling fields to the engine's `GenerateRequest`.

Defaults follow OpenAI (temperature 1, top_p 1); `max_tokens` left out (None)
takes the engine's `--max-tokens` when the operator set one, else the context
left; the engine clamps any limit to the context left.
"""

from __future__ import annotations

import uuid
from typing import Mapping, Sequence

from backends.base import SEEDS, SamplingParams
from server.engine.api import GenerateRequest, Scope
from server.engine.sessions import check_session_id
from server.errors import invalid
from server.api.openai import SamplingFields

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


def check_supported(body: SamplingFields, max_n: int) -> None:
    if body.n > max_n:
        raise invalid("n", f"n is at most {max_n} (--max-n), got {body.n}")


def generate_request(body: SamplingFields, prompt: list[int], *, rid: str, vocab_size: int, max_tokens: int | None,
                     session: str | None, scope: Scope = Scope(), logprobs: bool = False,
                     top_logprobs: int = 0) -> GenerateRequest:
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise invalid("logit_bias", f"logit_bias keys are token ids in [0, {vocab_size}), got {key!r}")
        bias[int(key)] = value
    if body.seed is not None and body.seed not in SEEDS:
        raise invalid("seed", f"seed is a signed or unsigned 64-bit integer, in [-2**63, 2**64), got {body.seed}")
    stop_ids = frozenset(body.stop_token_ids or ())
    if any(t >= vocab_size for t in stop_ids):
        raise invalid("stop_token_ids", f"stop_token_ids are token ids in [0, {vocab_size})")
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
