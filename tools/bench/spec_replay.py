"""Offline acceptance: the drafters replayed over greedy replies, as verification would take them.

For each reply, in the order the daemon finished them: from the first output token on, the
request's drafter proposes up to `limit` tokens after the committed text; the accepted run is
the draft's common prefix with the reply; the step commits it and one token more (the verify
pass's own). The drafter hears each outcome (`verified`) and, at the end, the reply joins the
scope's corpus (`close`), as in the daemon. Prompts are the chat template's tokens and replies the
tokenizer's tokens of the text: the same tokens as the model's wherever its text round-trips.
"""

from __future__ import annotations

from kvfork.server.engine.worker.drafts import Drafts
from kvfork.tools.bench.spec_workloads import SpecJob


def replay_one(drafts: Drafts, scope: str, prompt: list[int], reply: list[int], limit: int) -> tuple[dict, int]:
    """({source: [drafted, accepted]}, verify steps) for one reply."""
    request = drafts.open(scope, prompt)
    assert request is not None
    counts, steps, i = {}, 0, 1
    while i < len(reply):
        draft = request.propose(reply[:i], limit)
        accepted = 0
        if draft is not None:
            while accepted < len(draft.tokens) and i + accepted < len(reply) \
                    and draft.tokens[accepted] == reply[i + accepted]:
                accepted += 1
            request.verified(draft, accepted)
            row = counts.setdefault(draft.source, [0, 0])
            row[0] += len(draft.tokens)
            row[1] += accepted
        i += accepted + 1
        steps += 1
    request.close(reply)
    return counts, steps


class Replay:
    """One drafter per workload (its own scope), fed the off daemon's replies run after run."""

    def __init__(self, model: str, mode: str, limit: int = 16) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.mode, self.limit = mode, limit
        self.drafts: dict[str, Drafts] = {}
        self.counts: dict[str, dict[str, list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}  # workload -> [reply tokens after the first, steps]

    def add(self, workload: str, replies: list[tuple[SpecJob, str]]) -> None:
        """Replies in the order they finished, each with the job it answers."""
        drafts = self.drafts.setdefault(workload, Drafts(self.mode, max_tokens=self.limit))
        for job, text in replies:
            rendered = self.tokenizer.apply_chat_template(job.messages, add_generation_prompt=True, tokenize=False)
            prompt = self.tokenizer.encode(rendered, add_special_tokens=False)
            reply = self.tokenizer.encode(text, add_special_tokens=False)
            counts, steps = replay_one(drafts, "bench", prompt, reply, self.limit)
            for source, (drafted, accepted) in counts.items():
                row = self.counts.setdefault(workload, {}).setdefault(source, [0, 0])
                row[0] += drafted
                row[1] += accepted
            total = self.tokens.setdefault(workload, [0, 0])
            total[0] += max(0, len(reply) - 1)
            total[1] += steps

    def summary(self) -> dict:
        out: dict[str, dict] = {}
        for workload, (tokens, steps) in self.tokens.items():
            per_step = tokens / steps if steps else 1.0
            sources = self.counts.get(workload) or {"none": [0, 0]}
            out[workload] = {s: {"drafted": d, "accepted": a, "acceptance": a / d if d else 0.0,
                                 "tokens_per_step": per_step} for s, (d, a) in sources.items()}
        return out
