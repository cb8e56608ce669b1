"""A request in an inference slot, as the runner thread runs it: its session, its sampler, its
progress through the prompt and the output, and its draft where it speculates."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

from kvfork.backends.base import SamplerState, Session
from kvfork.server.engine import messages as m
from kvfork.server.engine.policy.draft_policy import PROBE_EVERY, Acceptance
from kvfork.server.engine.worker.drafts import Draft, RequestDrafts


@dataclass
class Seq:
    """A request in an inference slot, as the runner runs it."""

    start: m.Start
    sid: int
    session: Session
    sampler: SamplerState
    prefilled: int = 0
    generated: int = 0
    next_token: int | None = None  # sampled, not yet committed
    choices: list[m.Choice] = field(default_factory=list)  # opened when the prompt's last logits are in
    capture_at: int = 0  # where its prompt is snapshot (Start.capture), 0: nowhere
    drafts: RequestDrafts | None = None  # its drafter, where it speculates
    draft: Draft | None = None  # what this step's decode row carries after its token
    draft_from: int = 0  # its tokens generated before this step's decode row
    speculated: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafted, accepted]
    acceptance: Acceptance = field(default_factory=Acceptance)  # its recent drafts' (draft_policy.py)
    # steps in a row it did not draft in, where the policy said they would not pay (it starts with a probe)
    skipped: int = PROBE_EVERY
    images: tuple[int, ...] = ()  # the ids of the images the backend holds for it (Backend.encode_images)

    @property
    def rid(self) -> int:
        return self.start.rid

    @cached_property
    def tenant(self) -> str:
        """Whose request it is (Start.scope: its tenant and cache_salt, as JSON; "" where none is given), read once:
        every step's plan asks (fair_share.sit_out)."""
        return json.loads(self.start.scope)[0] if self.start.scope else ""

    @property
    def prefill_left(self) -> int:
        return max(0, len(self.start.prompt) - self.session.position)

    def whole(self) -> tuple[tuple[int, int], ...]:
        """Its prompt's images that one chunk must hold whole and are still to prefill, counted from its next
        token (scheduler.chunk_outside)."""
        position = self.session.position
        return tuple((i.start - position, i.end - position) for i in self.start.images if i.whole and i.end > position)

    def prefill_cap(self, orders: int | None) -> int | None:
        """Most tokens it may prefill this step: up to a follower's target (`orders`), and up to its capture."""
        position = self.session.position
        if position < self.capture_at < len(self.start.prompt):
            return min(self.capture_at - position, orders or self.prefill_left)
        return orders
