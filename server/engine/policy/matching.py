"""Which computed KV state serves the start of a new request's prompt: pure policy.

The engine calls:
  common_prefix(a, b, start=0) -> int
  Source.donor(request_id, prompt, committed, admitted, *, text=True, clone_floor=0, positions=None) -> Source
  Source.entry(key, tokens, stamp, *, clone_floor=0, positions=None) -> Source
  window_floor(position, windows) -> int           # clone_floor of a state with sliding layers
  usable_match(prompt, source) -> int
  usable_upto(shared, prompt, source) -> int  # the same rule, the shared length known (index.py)
  ranked_matches(prompt, sources) -> list[SourceMatch]   # prefix cache: try in order while clones are refused
  best_match(prompt, sources) -> SourceMatch | None
  choose_reuse(recipient, donors, cached, min_tokens) -> ReuseChoice   # at admission
  ReuseChoice.log_fields() -> dict                  # for the per-request log line

Rules (each also stated where it binds):
  - usable = min(common prefix, source's committed position, recipient length - 1), never inside an
    image (rounded down to its first token: an image is reused whole or not at all);
    a donor is matched on its PROMPT only, never its generated output.
  - Longest usable match wins; ties go to the most recent (donor admission order,
    cache LRU stamp). The prefix cache and active reuse share this one rule: a
    donor is a `Source` whose committed position is the one the runner published;
    a cache entry is a `Source` whose exact tokens are all committed.
  - `upto` is fixed at selection: the donor's committed prompt prefix never changes.
  - A state with sliding layers only serves what its windows still hold
    (clone_floor, from window_floor); a clone refused anyway falls back.
  - A state with recurrent layers serves only the positions it holds a state at
    (`positions`, from backends.base.clone_positions: its own position and its
    checkpoints): the match is the highest of them at or below the usable one.
  - Only anonymous recipients take part; named sessions keep their own path. Any
    active request, named or not, donates (a prompt with images too: its images are
    tokens of their own, backends/vision/keys.py).
  - min_tokens == 0 disables active reuse; otherwise a donor must save at least
    min_tokens prefill tokens beyond the best cached match, and an equally useful
    cached prefix wins.
Cost: common_prefix binary-searches with C-speed slice comparisons (~10-20 us for
2,000 shared tokens), so ranking 8 donors or 16 cache entries per admission is
negligible next to a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Hashable, Iterable, Literal, Sequence

from kvfork.backends.vision.keys import image_start

_BLOCK = 64


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """How many leading tokens a and b share. `start`: a length the caller knows they share."""
    n = min(len(a), len(b))
    if type(a) is not type(b):  # [1] != (1,): compare like with like
        a, b = tuple(a[:n]), tuple(b[:n])
    lo, hi = min(start, n), n
    # The first difference lies in [lo, hi). Slice comparisons run at C speed, so
    # check the next block (early divergence is common), then halve the range.
    if a[lo:lo + _BLOCK] != b[lo:lo + _BLOCK]:
        hi = min(hi, lo + _BLOCK)
    while hi - lo > _BLOCK:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def window_floor(position: int, windows: Iterable[int]) -> int:
    """Smallest `upto` a state at `position` can serve, given its sliding layers' windows.

    A sliding layer of window W keeps at least the last W positions, and a clone at
    `upto` needs [upto - W + 1, upto) (backends.base.clone_refusal): past W, only
    upto >= position - 1 is guaranteed. No sliding layers: 0.
    """
    window = min(windows, default=None)
    return 0 if window is None or position <= window else position - 1


@dataclass(frozen=True)
class Source:
    """KV state a recipient may clone a prefix of: an active request or a prefix-cache entry."""

    key: Hashable  # request id, or cache entry key
    # Only the PROMPT of an active donor: its generated output is never matched,
    # because another request's sampled tokens are not part of any shared prompt.
    tokens: Sequence[int]
    committed: int  # positions computed: the runner's published position, or len(tokens) for an entry
    recency: int  # higher = more recent: admission order of a donor, LRU stamp of an entry
    text: bool = True  # multimodal prompts neither give nor take
    # Smallest `upto` the state can still serve. Sliding-window layers forget old
    # positions (backends.base.clone_refusal); 0 for full attention.
    clone_floor: int = 0
    # The only `upto`s it can serve (recurrent layers: base.clone_positions); None: any from clone_floor up.
    positions: Collection[int] | None = None

    @classmethod
    def donor(cls, request_id: Hashable, prompt: Sequence[int], committed: int, admitted: int, *,
              text: bool = True, clone_floor: int = 0, positions: Collection[int] | None = None) -> Source:
        return cls(request_id, prompt, committed, admitted, text, clone_floor, positions)

    @classmethod
    def entry(cls, key: Hashable, tokens: Sequence[int], stamp: int, *, clone_floor: int = 0,
              positions: Collection[int] | None = None) -> Source:
        return cls(key, tokens, len(tokens), stamp, True, clone_floor, positions)


def usable_match(prompt: Sequence[int], source: Source) -> int:
    """Tokens of `prompt` the source can hand over: 0 when it can hand over none (`usable_upto`)."""
    if not source.text or source.committed <= 0:  # nothing computed: skip the comparison
        return 0
    return usable_upto(common_prefix(prompt, source.tokens), prompt, source)


def usable_upto(shared: int, prompt: Sequence[int], source: Source) -> int:
    """What a source sharing `shared` leading tokens with `prompt` can hand over.

    usable = min(common prefix, source's committed position, len(prompt) - 1), moved back to an image's
    first token where it falls inside one (backends/vision/keys.py)
    """
    # The last prompt token always runs through the model: the recipient needs
    # its own next-token logits for its own sampler.
    if not source.text or source.committed <= 0:
        return 0
    upto = image_start(prompt, min(shared, source.committed, len(prompt) - 1))
    if source.positions is not None:  # a recurrent state: only where one is held
        upto = max((p for p in source.positions if p <= upto), default=0)
    return upto if upto > 0 and upto >= source.clone_floor else 0


@dataclass(frozen=True)
class SourceMatch:
    key: Hashable
    upto: int  # clone [0, upto): fixed here, the donor's committed prompt prefix never changes
    recency: int


def _matches(prompt: Sequence[int], sources: Iterable[Source]) -> Iterable[SourceMatch]:
    return (SourceMatch(s.key, u, s.recency) for s in sources if (u := usable_match(prompt, s)) > 0)


def _rank(m: SourceMatch) -> tuple[int, int]:
    return m.upto, m.recency  # the longest match wins; ties go to the most recent


def ranked_matches(prompt: Sequence[int], sources: Iterable[Source]) -> list[SourceMatch]:
    """Every usable match, best first."""
    return sorted(_matches(prompt, sources), key=_rank, reverse=True)


def best_match(prompt: Sequence[int], sources: Iterable[Source]) -> SourceMatch | None:
    return max(_matches(prompt, sources), key=_rank, default=None)


@dataclass(frozen=True)
class Recipient:
    request_id: Hashable
    prompt: Sequence[int]
    session_id: str | None = None  # named session: warm resume, never a reuse recipient
    text: bool = True


ReuseKind = Literal["donor", "cache", "none"]
ReuseReason = Literal["donor", "disabled", "named_session", "not_text", "no_donor", "below_threshold", "cache_wins"]


@dataclass(frozen=True)
class ReuseChoice:
    kind: ReuseKind  # clone from `donor`, clone from the prefix cache, or prefill it all
    upto: int  # tokens reused: the donor match, or the cached match
    donor: Hashable | None  # request id when kind == "donor"
    donor_match: int  # best usable donor match (0: none), whatever was chosen
    cached_match: int
    min_tokens: int
    reason: ReuseReason

    def log_fields(self) -> dict:
        return {"reuse": self.kind, "reuse_upto": self.upto, "donor": self.donor, "donor_match": self.donor_match,
                "cached_match": self.cached_match, "reuse_min_tokens": self.min_tokens, "reuse_reason": self.reason}


def choose_reuse(recipient: Recipient, donors: Iterable[Source], cached: int, min_tokens: int) -> ReuseChoice:
    """Clone-now: the choice made when an anonymous text request is admitted.

    `donors` are the active requests (prefilling or decoding, named or not);
    `cached` is the best prefix-cache match for the recipient (0 if none).
    """
    def choice(kind: ReuseKind, reason: ReuseReason, match: SourceMatch | None = None) -> ReuseChoice:
        donor_match = match.upto if match else 0
        upto = donor_match if kind == "donor" else cached if kind == "cache" else 0
        return ReuseChoice(kind, upto, match.key if kind == "donor" and match else None,
                           donor_match, cached, min_tokens, reason)

    # Named sessions resume their own state; multimodal prompts keep their own
    # path. Neither takes part in prefix reuse, as recipient, whatever is cached.
    if recipient.session_id is not None:
        return choice("none", "named_session")
    if not recipient.text:
        return choice("none", "not_text")
    fallback: ReuseKind = "cache" if cached > 0 else "none"
    if min_tokens <= 0:
        return choice(fallback, "disabled")
    match = best_match(recipient.prompt, (d for d in donors if d.key != recipient.request_id))
    if match is None:
        return choice(fallback, "no_donor")
    # Active reuse must save at least `min_tokens` prefill tokens BEYOND the best
    # cached match; an equally useful cached prefix wins (it costs the donor nothing).
    if match.upto - cached >= min_tokens:
        return choice("donor", "donor", match)
    return choice(fallback, "cache_wins" if cached >= match.upto else "below_threshold", match)
