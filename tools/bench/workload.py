"""Workloads: calls, what triggers each one, and the seeded presets.

A workload is a flat list of calls. Each call names the call whose event
(sent, first token streamed, done) releases it, plus a delay, so sessions,
think time, forked sub-agents and staggering are all one mechanism. Every
prompt is fixed by the seed, never by what a server answered, so two passes of
one workload send identical prompts and their greedy outputs can be compared.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from kvfork.tools.bench.text import tool_definitions, words

# "idle": once every call listed before it is done (the server is idle then).
Trigger = Literal["start", "first_token", "done", "idle"]


@dataclass(frozen=True)
class Call:
    id: str
    session: str
    messages: list[dict]
    max_tokens: int
    after: str | None = None  # the call whose `on` event releases this one; None: the run's start
    on: Trigger = "done"
    delay_s: float = 0.0  # wait after the trigger (think time, stagger delay)
    not_before_s: float = 0.0  # never sent before this offset from the run's start (traces)
    tag: str = "root"  # root | fork | sub | lead | recipient | tail | trace: how the report groups it


@dataclass
class Workload:
    name: str
    calls: list[Call]
    # Root sessions hold one of `root_concurrency` places from their first call
    # to the end of their last; sub-agents and one-shot requests hold none.
    roots: list[str] = field(default_factory=list)
    root_concurrency: int | None = None


@dataclass
class Options:
    """Knobs shared by the presets; each preset reads the ones it needs."""

    seed: int = 0
    scale: float = 1.0
    n: int = 4  # burst/staggered: number of requests
    prefix_tokens: int = 1500  # shared system prompt + tool definitions
    tail_tokens: int = 40  # burst/staggered: each request's own last message
    max_tokens: tuple[int, int] = (16, 32)
    think_s: float = 0.0
    root_concurrency: int = 1
    stagger_delay_s: float | None = None  # staggered: None = on the previous first token


def _max_tokens(rng: random.Random, opts: Options) -> int:
    return rng.randint(*opts.max_tokens)


def _system(opts: Options, name: str) -> dict:
    # The prefix depends on the preset name so presets run back to back on one
    # server never find each other's prompts in its prefix cache.
    rng = random.Random(f"{opts.seed}:{name}:system")
    return {"role": "system", "content": tool_definitions(rng, opts.prefix_tokens)}


def _turn(rng: random.Random, k: int) -> list[dict]:
    """One agent step: the assistant's tool call, then the tool's result."""
    act = f"Calling tool_{rng.randint(0, 9)} on src/mod_{k}.py: {words(rng, rng.randint(8, 20))}"
    result = f"Tool result {k}:\n{words(rng, rng.randint(40, 120))}"
    return [{"role": "assistant", "content": act}, {"role": "user", "content": result}]


def shared_prefix(name: str, opts: Options, *, staggered: bool) -> Workload:
    """N requests sharing one long prefix, each with its own last message.

    Staggered, two references follow, one call at a time on the idle server:
    each recipient's last message alone (tag "tail"), the TTFT a recipient's is
    measured against (reusing the prefix should cost little more than that); and
    the shared prefix with a fresh last message of the same size (tag "warm"):
    the recipient's own work, its tail prefilled over the cached prefix, with
    nothing else running, so recipient / warm is what waiting among the other
    requests' steps adds.
    """
    system = _system(opts, name)
    calls, tails, warms = [], [], []
    for i in range(opts.n):
        rng = random.Random(f"{opts.seed}:{name}:{i}")
        tail = {"role": "user", "content": f"Request {i}: {words(rng, opts.tail_tokens)}"}
        msgs = [system, tail]
        prev = f"{name}-{i - 1}" if staggered and i else None
        if prev is None:
            trigger = dict()
        elif opts.stagger_delay_s is None:
            trigger = dict(after=prev, on="first_token")
        else:
            trigger = dict(after=prev, on="start", delay_s=opts.stagger_delay_s)
        tag = "recipient" if i else "lead"
        calls.append(Call(f"{name}-{i}", f"{name}-{i}", msgs, _max_tokens(rng, opts), tag=tag, **trigger))
        if staggered and i:
            # an empty system message keeps a chat template's default one out of the tail
            alone = [{"role": "system", "content": ""}, tail]
            tails.append(Call(f"{name}-tail-{i}", f"{name}-tail-{i}", alone, 1, on="idle", tag="tail"))
            fresh = {"role": "user", "content": f"Request {i} again: {words(rng, opts.tail_tokens)}"}
            warms.append(Call(f"{name}-warm-{i}", f"{name}-warm-{i}", [system, fresh], 1, on="idle", tag="warm"))
    return Workload(name, calls + tails + warms)


def agentic(name: str, opts: Options, *, sessions: int, total_calls: int) -> Workload:
    """Root agents resending prefix + growing history; a sub-agent forks mid-session."""
    system = _system(opts, name)
    calls: list[Call] = []
    roots = []
    per, extra = divmod(max(total_calls, 2 * sessions), sessions)
    for s in range(sessions):
        rng = random.Random(f"{opts.seed}:{name}:session{s}")
        n = per + (s < extra)
        n_sub = max(2, n // 6) if n >= 6 else 0
        fork_at = (n - n_sub) // 3
        sid = f"s{s}"
        roots.append(sid)
        history = [system, {"role": "user", "content": f"Task {s}: {words(rng, rng.randint(20, 40))}"}]
        prev = None
        for k in range(n - n_sub):
            cid = f"{sid}-{k}"
            calls.append(
                Call(cid, sid, list(history), _max_tokens(rng, opts), after=prev, delay_s=opts.think_s if prev else 0)
            )
            if k == fork_at and n_sub:
                calls += _sub_agent(rng, opts, sid, cid, history, n_sub)
            history += _turn(rng, k)
            prev = cid
    return Workload(name, calls, roots, opts.root_concurrency)


def _sub_agent(rng: random.Random, opts: Options, sid: str, donor: str, history: list[dict], n: int) -> list[Call]:
    # Forked from the root's history while the root call `donor` is decoding:
    # its whole prompt is then computed and can be cloned.
    sub = f"{sid}.sub"
    msgs = history + [
        {"role": "assistant", "content": f"Spawning a sub-agent: {words(rng, 10)}"},
        {"role": "user", "content": f"Sub-task: {words(rng, rng.randint(20, 40))}"},
    ]
    calls, prev, on = [], donor, "first_token"
    for k in range(n):
        cid = f"{sub}-{k}"
        calls.append(Call(cid, sub, list(msgs), _max_tokens(rng, opts), after=prev, on=on,
                          tag="sub" if k else "fork", delay_s=opts.think_s if k else 0))
        msgs += _turn(rng, k)
        prev, on = cid, "done"
    return calls


# The C++ system's agent replay (its pull request's workload): 20 sessions, about 684 calls, root
# concurrency 1, 8 inference slots.
AGENTX_SESSIONS, AGENTX_CALLS, AGENTX_SLOTS = 20, 684, 8


def build(preset: str, opts: Options) -> Workload:
    if preset == "agentx-mini":
        sessions = max(1, round(AGENTX_SESSIONS * opts.scale))
        return agentic(preset, opts, sessions=sessions, total_calls=round(AGENTX_CALLS * opts.scale))
    if preset in ("burst", "staggered"):
        return shared_prefix(preset, opts, staggered=preset == "staggered")
    raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")


PRESETS = ("agentx-mini", "burst", "staggered")
