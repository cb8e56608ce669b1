"""The speculative decoding benchmark's workloads: seeded chat prompts, one list per run.

- code-edit: a ~150-line Python file (about 2,000 tokens) and a request to return it whole with
  small changes: the reply restates the prompt, what drafts from the prompt are for;
- agent: the calls of the bench's agent preset (agentx-mini: tool definitions, growing tool
  histories, a forked sub-agent);
- prose: a short story on a seeded topic, with nothing to copy.

Each run has its own seed, so no run's prompts are another's: a suffix corpus holds earlier runs'
replies, never this run's.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kvfork.tools.bench.text import words
from kvfork.tools.bench.workload import Options, agentic

WORKLOADS = ("code-edit", "agent", "prose")
_NOUNS = "cache token request session buffer record index table queue worker batch route".split()
_VERBS = "load parse merge split check build read write flush trim sort scan".split()


@dataclass(frozen=True)
class SpecJob:
    messages: list[dict]
    max_tokens: int
    reference: str = ""  # the reply a model that does as asked writes (code-edit, agent), for offline acceptance


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _function(rng: random.Random, name: str) -> list[str]:
    arg, other = rng.sample(_NOUNS, 2)
    body = [f"def {name}({arg}: list[int], limit: int = {rng.randint(2, 64)}) -> dict[str, int]:",
            f'    """{words(rng, rng.randint(6, 12))}"""',
            f"    {other}: dict[str, int] = {{}}",
            f"    for i, value in enumerate({arg}):"]
    for _ in range(rng.randint(2, 5)):
        body.append(f"        if value % {rng.randint(2, 9)} == {rng.randint(0, 1)}:")
        body.append(f'            {other}["{rng.choice(_NOUNS)}_" + str(i)] = value * {rng.randint(2, 99)}')
    body += [f"    if len({other}) > limit:", f"        raise ValueError(f\"too many: {{len({other})}}\")",
             f"    return {other}", ""]
    return body


def code_file(rng: random.Random, lines: int = 150) -> tuple[str, list[str]]:
    """A Python module of about `lines` lines, and its functions' names."""
    out, names = ['"""' + words(rng, 12) + '"""', "", "from __future__ import annotations", "", ""], []
    while len(out) < lines or len(names) < 2:  # two at least: one renamed, one edited
        name = f"{_name(rng)}_{len(names)}"
        names.append(name)
        out += _function(rng, name)
    return "\n".join(out), names


def code_edit(seed: int, count: int, lines: int, max_tokens: int) -> list[SpecJob]:
    jobs = []
    for i in range(count):
        rng = random.Random(f"{seed}:code-edit:{i}")
        text, names = code_file(rng, lines)
        old, limited = rng.sample(names, 2)
        ask = (f"Here is src/mod_{i}.py:\n```python\n{text}\n```\nRename the function `{old}` to `{old}_v2` and "
               f"change the default limit of `{limited}` to 128. Reply with the whole updated file in one code block.")
        edited = re.sub(rf"(def {limited}\(.*limit: int = )\d+", r"\g<1>128", text.replace(f"def {old}(", f"def {old}_v2("))
        jobs.append(SpecJob([{"role": "user", "content": ask}], max_tokens, f"```python\n{edited}\n```"))
    return jobs


def agent(seed: int, count: int, max_tokens: int) -> list[SpecJob]:
    """`count` calls of the agent preset (its sessions' histories, in order)."""
    opts = Options(seed=seed, scale=1.0, max_tokens=(max_tokens, max_tokens))
    calls = agentic("agentx-mini", opts, sessions=max(1, count // 4), total_calls=count).calls[:count]
    # a call's reference: the assistant turn its session's script says next
    after = {c.id: n for c, n in zip(calls, calls[1:]) if n.session == c.session and len(n.messages) > len(c.messages)}
    return [SpecJob(c.messages, c.max_tokens,
                    after[c.id].messages[len(c.messages)]["content"] if c.id in after else "")
            for c in calls]


def prose(seed: int, count: int, max_tokens: int) -> list[SpecJob]:
    jobs = []
    for i in range(count):
        rng = random.Random(f"{seed}:prose:{i}")
        topic = f"a {rng.choice(_NOUNS)} keeper who finds {words(rng, 4).lower().rstrip('.')}"
        jobs.append(SpecJob([{"role": "user", "content": f"Write an original short story about {topic}."}], max_tokens))
    return jobs


def jobs(workload: str, seed: int, count: int, *, code_lines: int, code_tokens: int, agent_tokens: int,
         prose_tokens: int) -> list[SpecJob]:
    if workload == "code-edit":
        return code_edit(seed, count, code_lines, code_tokens)
    if workload == "agent":
        return agent(seed, count, agent_tokens)
    if workload == "prose":
        return prose(seed, count, prose_tokens)
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
