"""Seeded filler text whose length in tokens is predictable.

Common short English words are one token each in the BPE vocabularies of the
models we serve (SmolLM2, Llama, Qwen), so `words(n)` is about n tokens. The
bench never relies on that count: it reports the server's own usage figures.
"""

from __future__ import annotations

import random

_WORDS = (
    "the of and to in is was for on that with as by at from it this be are or have not but had "
    "his they you were her she which their all will there would one what so out if about who get "
    "them when make can like time no just him know take people into year your good some could see "
    "other than then now look only come its over think also back after use two how our work first "
    "well way even new want because any these give day most us file read write search open list "
    "test code line value error result call function name path run build check find change update "
    "return field type string number table row column server client request answer step plan task "
    "agent tool note data cache token prompt model output input start stop next last long short"
).split()


def words(rng: random.Random, n: int) -> str:
    """About `n` tokens of plain text, with sentence breaks every dozen words or so."""
    out: list[str] = []
    while len(out) < n:
        sentence = [rng.choice(_WORDS) for _ in range(min(rng.randint(6, 14), n - len(out)))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out.extend(sentence)
    return " ".join(out)


def tool_definitions(rng: random.Random, n_tokens: int) -> str:
    """A system prompt shaped like an agent's: instructions, then tool signatures."""
    # Seeded words first, so prompts of different seeds share no leading tokens.
    lines = [words(rng, 10), "You are a careful software agent. Use the tools below; answer briefly.", "Tools:"]
    used = 30
    i = 0
    while used < n_tokens:
        desc = words(rng, min(rng.randint(20, 40), max(1, n_tokens - used - 8)))
        lines.append(f"- tool_{i}(path: str, query: str): {desc}")
        used += len(desc.split()) + 12
        i += 1
    return "\n".join(lines)
