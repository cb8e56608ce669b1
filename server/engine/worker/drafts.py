"""Model-free drafts for speculative decoding: prompt lookup and suffix decoding.

Both sources guess the tokens that follow a request's text from text already seen:

- prompt lookup: the request's own prompt and output. The longest recent match of its tail
  (at least `MIN_MATCH` tokens) proposes what followed it.
- suffix decoding (SuffixDecoding, arXiv 2411.04975): the finished responses of the same
  scope (one tenant and cache_salt; never another scope's text), bounded in bytes and
  evicted oldest first. Every occurrence of the tail's longest match votes for what comes
  next, so the draft follows the most frequent continuation while its path probability
  stays at or above `MIN_PATH_PROB`.

One structure serves both (`TokenIndex`): a flat token array and, for every `KEY_TOKENS`-gram,
the most recent positions right after it; these positions are the occurrences of the
matched suffix, which is what a node of a suffix tree holds. It is indexed incrementally
(each new token costs one dict update) and a proposal reads at most `CANDIDATES` occurrences,
each compared over at most `MAX_MATCH` tokens: its work does not grow with the prompt.

The draft length adapts per request (`Adaptation`) and a request whose drafts are rarely
accepted stops drafting. Everything here runs on the runner thread: no locks.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from kvfork.server.engine.config import SPECULATIVE_MODES

KEY_TOKENS = 2  # an n-gram of this many tokens keys the index; also the shortest match that drafts
MIN_MATCH = KEY_TOKENS
MAX_MATCH = 32  # a match is compared this far back at most
CANDIDATES = 32  # most recent occurrences of a key kept and read
# A prompt is indexed from its end backwards, this many tokens per proposal, so a 150k-token prompt
# never stalls the runner thread (its most recent text, the likeliest to be restated, comes first).
INDEX_CHUNK = 1024
MATCH_FACTOR = 2  # a draft is at most this many times as long as the match that proposed it
MIN_PATH_PROB = 0.1  # SuffixDecoding's threshold: stop where fewer than this share of occurrences agree
SEPARATOR = -1  # between a corpus' entries, so no match runs from one response into the next
_SHIFT = 21  # token ids below 2**21 (every vocabulary in use) pack a key into one int

# Estimated bytes of the structures in CPython, for the corpus budget: a token in an
# array('i'); a position in an array('q'); a key: its int, its position array's header
# and its dict slot.
TOKEN_BYTES, POSITION_BYTES, KEY_BYTES = 4, 8, 32 + 80 + 48
# A scope's corpus costs this much before its first token (measured with tracemalloc: its Corpus and
# TokenIndex with their attribute dicts, the empty arrays, dict and deque, its slot in Drafts.corpora),
# plus its name's characters, and each entry a slot in two deques: a corpus per request (a cache_salt
# that changes every time) costs what it holds.
SCOPE_BYTES, ENTRY_BYTES = 1536, 16

# Adaptation: drafts start `INITIAL_LENGTH` long; a draft accepted in full lengthens the next
# by `GROW`, one rejected early shortens it to the accepted run plus one (transformers' "heuristic"
# schedule for assisted generation, with a larger step: on a copied file, +4 takes 9.3 tokens a
# step where +2 takes 7.4, `kvfork bench spec --reference`). Acceptance is an exponential average
# (weight `RATE_WEIGHT` per draft); once `WARMUP_DRAFTS` drafts are verified and it stays
# below `OFF_RATE`, the request stops drafting: a rejected token costs a row of the verify pass.
INITIAL_LENGTH, GROW = 4, 4
RATE_WEIGHT, WARMUP_DRAFTS, OFF_RATE = 0.2, 8, 0.2


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    source: str  # "prompt" | "suffix" (metrics label)
    score: float = 0.0  # expected accepted tokens: the sum of the path's probabilities


def _key(tokens: Sequence[int], end: int) -> int:
    key = 0
    for t in tokens[end - KEY_TOKENS:end]:
        key = (key << _SHIFT) | (t & ((1 << _SHIFT) - 1))
    return key


class TokenIndex:
    """Tokens at global positions `base`.. and, per key, the most recent positions right after it.

    `work` counts the elementary steps done (index updates, token comparisons), for tests
    that bound a proposal's cost without timing it."""

    def __init__(self) -> None:
        self.tokens = array("i")
        self.base = 0  # global position of tokens[0]; grows as the oldest entries leave
        self.positions: dict[int, array] = {}
        self.bytes = 0
        self.work = 0
        self.pending = 0  # loaded tokens [0, pending) whose keys are not indexed yet

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens and index them now."""
        for t in tokens:
            self.tokens.append(t)
            self.bytes += TOKEN_BYTES
            self._index(len(self.tokens), newest=True)

    def load(self, tokens: Sequence[int]) -> None:
        """Append tokens and leave their indexing to `catch_up` (at most a chunk at a time)."""
        self.tokens.extend(tokens)
        self.bytes += len(tokens) * TOKEN_BYTES
        self.pending = len(self.tokens)

    def catch_up(self, budget: int) -> None:
        """Index up to `budget` loaded tokens, the most recent first."""
        stop = max(KEY_TOKENS - 1, self.pending - budget)
        for n in range(self.pending, stop, -1):
            self._index(n, newest=False)
        self.pending = min(self.pending, stop)

    def _index(self, n: int, newest: bool) -> None:
        """Index the key ending at tokens[n - 1]: after every occurrence indexed so far (`newest`)
        or before them (a loaded prompt, indexed backwards: kept only while a key has few)."""
        self.work += 1
        if n < KEY_TOKENS or SEPARATOR in self.tokens[n - KEY_TOKENS:n]:
            return
        key = _key(self.tokens, n)
        found = self.positions.get(key)
        if found is None:
            found = self.positions[key] = array("q")
            self.bytes += KEY_BYTES
        if not newest:
            if len(found) < CANDIDATES:
                found.insert(0, self.base + n)
                self.bytes += POSITION_BYTES
            return
        found.append(self.base + n)
        self.bytes += POSITION_BYTES
        if len(found) > 2 * CANDIDATES:  # keep the most recent: amortized O(1)
            drop = len(found) - CANDIDATES
            del found[:drop]
            self.bytes -= drop * POSITION_BYTES

    def drop_front(self, count: int) -> None:
        """Forget the oldest `count` tokens and every position inside them."""
        gone, self.base = self.tokens[:count], self.base + count
        del self.tokens[:count]
        self.bytes -= count * TOKEN_BYTES
        for end in range(KEY_TOKENS, len(gone) + 1):
            key = _key(gone, end)
            found = self.positions.get(key)
            if found is None:
                continue
            stale = bisect_left(found, self.base + 1)
            del found[:stale]
            self.bytes -= stale * POSITION_BYTES
            if not found:
                del self.positions[key]
                self.bytes -= KEY_BYTES

    def at(self, position: int) -> int:
        i = position - self.base
        return self.tokens[i] if 0 <= i < len(self.tokens) else SEPARATOR

    def draft(self, tail: Sequence[int], limit: int) -> tuple[list[int], float]:
        """The most frequent continuation of the tail's longest match, and its score (0: none)."""
        if limit < 1 or len(tail) < KEY_TOKENS:
            return [], 0.0
        found = self.positions.get(_key(tail, len(tail)))
        if not found:
            return [], 0.0
        matched = [(self._match(tail, p), p) for p in reversed(found[-CANDIDATES:]) if p < self.end]
        longest = max((m for m, _ in matched), default=0)
        if longest < MIN_MATCH:
            return [], 0.0
        occurrences = [p for m, p in matched if m == longest]
        return self._follow(occurrences, min(limit, MATCH_FACTOR * longest))

    def _match(self, tail: Sequence[int], position: int) -> int:
        """How many tokens before `position` equal the tail's last ones (at most MAX_MATCH)."""
        n = 0
        bound = min(MAX_MATCH, len(tail), position - self.base)
        while n < bound and self.at(position - 1 - n) == tail[len(tail) - 1 - n]:
            n += 1
        self.work += n + 1
        return n

    def _follow(self, occurrences: list[int], limit: int) -> tuple[list[int], float]:
        """Greedy walk down the occurrences' continuations: each step takes the token most of the
        remaining occurrences agree on while the path's probability stays >= MIN_PATH_PROB."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        live = occurrences
        while live and len(out) < limit:
            votes: dict[int, list[int]] = {}
            for p in live:
                t = self.at(p + len(out))
                if t != SEPARATOR:
                    votes.setdefault(t, []).append(p)
            self.work += len(live)
            if not votes:
                break
            token, agree = max(votes.items(), key=lambda kv: len(kv[1]))
            if prob * len(agree) / len(live) < MIN_PATH_PROB:
                break
            prob *= len(agree) / len(live)
            score += prob
            out.append(token)
            live = agree
        return out, score


class Corpus:
    """One scope's finished responses, oldest first, in one index."""

    def __init__(self) -> None:
        self.index = TokenIndex()
        self.entries: deque[int] = deque()  # each entry's length, separator included

    def add(self, tokens: Sequence[int]) -> None:
        self.index.extend([*tokens, SEPARATOR])
        self.entries.append(len(tokens) + 1)

    def evict_oldest(self) -> None:
        self.index.drop_front(self.entries.popleft())

    def nbytes(self, scope: str) -> int:
        """Its estimated bytes: the scope's fixed cost, its entries and its index."""
        return SCOPE_BYTES + len(scope) + ENTRY_BYTES * len(self.entries) + self.index.bytes


class Adaptation:
    """A request's draft length and acceptance, and whether it still drafts."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.length = min(INITIAL_LENGTH, max_tokens)
        self.rate = 1.0
        self.verified = 0
        self.active = max_tokens > 0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted < 1:
            return
        self.verified += 1
        self.rate += RATE_WEIGHT * (accepted / drafted - self.rate)
        if accepted >= drafted:
            self.length = min(self.max_tokens, self.length + GROW)
        else:
            self.length = max(1, accepted + 1)
        if self.verified >= WARMUP_DRAFTS and self.rate < OFF_RATE:
            self.active = False


class Drafts:
    """One per engine: the suffix corpora by scope, bounded in bytes, evicted by age."""

    def __init__(self, mode: str, max_tokens: int = 16, corpus_bytes: int = 64 * 1024**2) -> None:
        if mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative: {mode!r} is not one of {', '.join(SPECULATIVE_MODES)}")
        self.mode, self.max_tokens, self.corpus_bytes = mode, max_tokens, corpus_bytes
        self.corpora: dict[str, Corpus] = {}
        self.ages: deque[str] = deque()  # the scope of every entry, oldest first
        self.bytes = 0  # estimated bytes of all corpora

    @classmethod
    def from_config(cls, config) -> "Drafts":
        return cls(config.speculative, config.speculative_tokens, config.speculative_corpus_bytes)

    def open(self, scope: str, prompt: Sequence[int]) -> RequestDrafts | None:
        if self.mode == "off":
            return None
        return RequestDrafts(self, scope, prompt)

    def remember(self, scope: str, output: Sequence[int]) -> None:
        """A finished response joins its scope's corpus; the oldest entries leave to stay in budget."""
        room = self.corpus_bytes - SCOPE_BYTES - len(scope) - ENTRY_BYTES
        fit = room // (TOKEN_BYTES + POSITION_BYTES + KEY_BYTES) - 1  # a token costs at most this
        keep = list(output[-fit:]) if fit > 0 else []
        if self.mode != "suffix" or len(keep) < KEY_TOKENS:
            return
        corpus = self.corpora.get(scope)
        if corpus is None:
            corpus = self.corpora[scope] = Corpus()
            self.bytes += corpus.nbytes(scope)
        before = corpus.nbytes(scope)
        corpus.add(keep)
        self.bytes += corpus.nbytes(scope) - before
        self.ages.append(scope)
        while self.bytes > self.corpus_bytes:
            name = self.ages.popleft()
            oldest = self.corpora[name]
            before = oldest.nbytes(name)
            oldest.evict_oldest()
            self.bytes += oldest.nbytes(name) - before
            if not oldest.entries:
                del self.corpora[name]
                self.bytes -= oldest.nbytes(name)

    def stats(self) -> dict:
        return {"corpus_bytes": self.bytes, "corpus_entries": len(self.ages), "scopes": len(self.corpora)}


class RequestDrafts:
    """One per request (one per choice): its own text's index, its scope's corpus, its adaptation."""

    def __init__(self, drafts: Drafts, scope: str, prompt: Sequence[int]) -> None:
        self.drafts, self.scope = drafts, scope
        self.corpus_work = 0
        self.closed = False
        self.own = TokenIndex()
        self.own.load(prompt)
        self.prompt_len = len(prompt)
        self.adaptation = Adaptation(drafts.max_tokens)

    @property
    def active(self) -> bool:
        return self.adaptation.active

    @property
    def work(self) -> int:
        """Elementary steps done for this request (see TokenIndex.work)."""
        return self.own.work + self.corpus_work

    def propose(self, output: Sequence[int], limit: int) -> Draft | None:
        """Up to min(limit, the adapted length) tokens guessed to follow the prompt and `output` (the
        request's tokens so far: only those not seen yet are read), from the source whose draft scores
        higher; None when neither has one."""
        if not self.active:
            return None
        self.own.catch_up(INDEX_CHUNK)
        seen = self.own.end - self.prompt_len
        if len(output) > seen:
            self.own.extend(output[seen:])
        n = min(limit, self.adaptation.length)
        tail = self.own.tokens[-MAX_MATCH:]
        guess, score = self.own.draft(tail, n)
        best = Draft(guess, "prompt", score)
        corpus = self.drafts.corpora.get(self.scope) if self.drafts.mode == "suffix" else None
        if corpus is not None:
            self.corpus_work -= corpus.index.work
            guess, score = corpus.index.draft(tail, n)
            past = Draft(guess, "suffix", score)
            self.corpus_work += corpus.index.work
            if past.score > best.score:
                best = past
        return best if best.tokens else None

    def verified(self, draft: Draft, accepted: int) -> None:
        self.adaptation.record(len(draft.tokens), accepted)

    def close(self, output: Sequence[int]) -> None:
        """The finished request's output joins its scope's corpus (once, however often it is called)."""
        if not self.closed:
            self.closed = True
            self.drafts.remember(self.scope, output)
