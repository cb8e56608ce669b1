"""Volatile client lines: text a client puts in a prompt that changes between requests and that no
model needs, taken out before the prompt is rendered so it never costs a prefill.

Each entry of `VOLATILE_LINES` names the client, what the line is, and the pattern of its structure: a
whole line (to its newline, or a whole system text block) that matches the pattern from its first
character to its last. Only `system` is read (never user text or tool descriptions), and nothing else
in it is touched. `--keep-volatile-lines` keeps them all.

Claude Code's billing line is the first: `x-anthropic-billing-header:` and then only `key=value;`
pairs. The keys vary by release and by who sends the request: the main agent's first system block is
`x-anthropic-billing-header: cc_version=2.1.332.<3 hex>; cc_entrypoint=sdk-cli;` (`cli` from the
interactive CLI), a subagent's adds `cc_is_subagent=true;`, work started from an async context
`cc_workload=<name>;`, a gateway `cc_gateway=<1|env>;`, and older releases (2.1.177) `cch=<5 hex>;`,
new on every request. The version's 3-hex suffix is derived from the session's (or the subagent's)
first prompt. Anthropic's servers ignore the line; a prefix cache that renders it sees a new prompt
at its first tokens, so two sessions, two subagents (or, with `cch`, two turns) share nothing. The
rule is the line's structure, not a list of its keys, so a key a new release adds is taken out too;
a line with anything else in it is kept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvfork.server.api.messages.protocol import TextBlock


@dataclass(frozen=True)
class VolatileLine:
    name: str  # what the line is, as /metrics and the log call it
    client: str
    pattern: re.Pattern[str]  # matches the whole line, nothing around it


_PAIR = r" ?[A-Za-z_][A-Za-z0-9_.-]*=[^\s;]+;"  # one `key=value;` (a value holds no space and no `;`), one space at most before it: linear to match

VOLATILE_LINES = (
    VolatileLine("claude_code_billing", "Claude Code (2.1.x)",
                 re.compile(rf"x-anthropic-billing-header:(?:{_PAIR})+ ?")),
)


def _volatile(line: str) -> VolatileLine | None:
    return next((v for v in VOLATILE_LINES if v.pattern.fullmatch(line)), None)


def strip_text(text: str) -> tuple[str, list[str]]:
    """`text` without its volatile lines (each with the blank lines right after it), and their names."""
    kept, removed, skip_blank = [], [], False
    for line in text.splitlines(keepends=True):
        found = _volatile(line.rstrip("\r\n"))
        if found is not None:
            removed.append(found.name)
            skip_blank = True
        elif not (skip_blank and not line.strip()):
            kept.append(line)
            skip_blank = False
    return ("".join(kept), removed) if removed else (text, [])


def strip_system(system: str | list[TextBlock] | None) -> tuple[str | list[TextBlock] | None, list[str]]:
    """A Messages `system` without volatile lines: a block that held nothing else is dropped."""
    if isinstance(system, str):
        return strip_text(system)
    if not system:
        return system, []
    blocks, removed = [], []
    for block in system:
        text, names = strip_text(block.text)
        removed += names
        if not names:
            blocks.append(block)
        elif text.strip():
            blocks.append(TextBlock(text))
    return blocks, removed
