"""A drafter double with drafts.Drafts' interface (server/engine/worker/drafts.py), for the runner's tests:
it drafts from the outputs it has seen in a scope (like suffix decoding over past responses),
else from the request's own text (a one-token prompt lookup), and spoils some drafts on purpose
so verification has to reject them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    source: str


class ScriptedDrafts:
    def __init__(self, spoil_every: int = 3, vocab: int = 500, fixed: list[int] | None = None,
                 raises: bool = False):
        """`spoil_every`: every that many proposals one token is wrong (0: never); `fixed`: always
        propose these tokens (source "prompt"); `raises`: propose raises (a broken drafter)."""
        self.spoil_every, self.vocab, self.fixed, self.raises = spoil_every, vocab, fixed, raises
        self.seen: dict[str, list[list[int]]] = {}  # scope -> prompt + output of finished requests
        self.opened: list[str] = []  # the scopes requests opened with
        self.proposals = 0
        self.proposed_tokens = 0

    def open(self, scope: str, prompt: Sequence[int]) -> "RequestDrafts":
        self.opened.append(scope)
        return RequestDrafts(self, scope, list(prompt))


class RequestDrafts:
    def __init__(self, owner: ScriptedDrafts, scope: str, prompt: list[int]):
        self.owner, self.scope, self.prompt = owner, scope, prompt
        self.results: list[tuple[int, int]] = []  # (drafted, accepted) per verified draft
        self.active = True

    def propose(self, output: Sequence[int], limit: int) -> Draft | None:
        o = self.owner
        if o.raises:
            raise RuntimeError("a broken drafter")
        if o.fixed is not None:
            return Draft(o.fixed[:limit], "prompt")
        tokens = self.prompt + list(output)
        guess, source = self._seen_after(tokens), "suffix"
        if not guess:
            guess, source = self._lookup(tokens), "prompt"
        guess = guess[:limit]
        if not guess:
            return None
        o.proposals += 1
        if o.spoil_every and o.proposals % o.spoil_every == 0:
            at = len(guess) // 2
            guess[at] = (guess[at] + 1) % o.vocab
        o.proposed_tokens += len(guess)
        return Draft(guess, source)

    def _seen_after(self, tokens: list[int]) -> list[int]:
        for seq in self.owner.seen.get(self.scope, []):
            if len(seq) > len(tokens) and seq[:len(tokens)] == tokens:
                return seq[len(tokens):]
        return []

    @staticmethod
    def _lookup(tokens: list[int]) -> list[int]:
        last = tokens[-1]
        for i in range(len(tokens) - 2, -1, -1):
            if tokens[i] == last:
                return tokens[i + 1:i + 5]
        return []

    def verified(self, draft: Draft, accepted: int) -> None:
        assert 0 <= accepted <= len(draft.tokens)
        self.results.append((len(draft.tokens), accepted))

    def close(self, output: Sequence[int]) -> None:
        self.owner.seen.setdefault(self.scope, []).append(self.prompt + list(output))
