"""The model-free drafters (server/engine/worker/drafts.py): prompt lookup, suffix corpora by scope, adaptation."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from kvfork.server.engine.worker import drafts as d
from kvfork.server.engine.worker.drafts import Draft, Drafts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def noise(n: int, seed: int = 0, vocab: int = 50_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def test_off_opens_nothing_and_an_unknown_mode_is_refused():
    assert Drafts("off").open("t", [1, 2, 3]) is None
    with pytest.raises(ValueError, match="'fast' is not one of off, prompt, suffix"):
        Drafts("fast")


def test_prompt_lookup_proposes_what_followed_the_longest_match():
    body = noise(40, seed=1)
    prompt = body + noise(30, seed=2) + body[:5]  # the reply starts restating `body`
    r = Drafts("prompt", max_tokens=8).open("t", prompt)
    draft = r.propose([], 8)
    assert draft == Draft(body[5:9], "prompt", 4.0)  # the adapted length (4) bounds it, not the limit
    assert r.propose([], 2).tokens == body[5:7]  # the caller's limit bounds it too


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    a, b = noise(10, seed=3), noise(10, seed=4)
    key = [7, 8]
    # [5, 7, 8] is followed by a; later [6, 7, 8] by b: a tail ending [5, 7, 8] must draft a
    prompt = [5, *key, *a, 6, *key, *b, 5, *key]
    draft = Drafts("prompt").open("t", prompt).propose([], 4)
    assert draft is not None and draft.tokens == a[:4]


def test_no_match_no_draft_and_the_output_is_indexed_as_it_grows():
    prompt = noise(50, seed=5)
    r = Drafts("prompt").open("t", prompt)
    assert r.propose([], 4) is None
    out = noise(6, seed=6)
    # the output repeats its own start
    assert r.propose(out + out[:2], 4).tokens == out[2:6]


def test_suffix_drafts_from_a_scopes_past_responses_only():
    drafts = Drafts("suffix")
    reply = noise(30, seed=7)
    request = drafts.open("tenant-a/salt", [1, 2, 3])
    request.close(reply)
    request.close(reply)  # once only
    tail = [42, *reply[:3]]
    mine = drafts.open("tenant-a/salt", tail).propose([], 4)
    assert mine == Draft(reply[3:7], "suffix", 4.0)
    assert drafts.stats() == {"corpus_bytes": drafts.bytes, "corpus_entries": 1, "scopes": 1}
    for other in ("tenant-b/salt", "tenant-a/other-salt"):
        assert drafts.open(other, tail).propose([], 4) is None
    assert Drafts("prompt").open("tenant-a/salt", tail).propose([], 4) is None  # prompt mode keeps no corpus


def test_suffix_follows_the_most_frequent_continuation_and_stops_at_the_threshold():
    drafts = Drafts("suffix", max_tokens=8)
    stem, common, rare = [11, 12, 13], [21, 22, 23, 24], [31, 32, 33, 34]
    for i in range(9):
        drafts.remember("s", [i + 1000, *stem, *common, 500 + i])
    drafts.remember("s", [*stem, *rare])
    r = drafts.open("s", [1, *stem])
    draft = r.propose([], 6)
    # 9 of 10 occurrences agree on `common`; after it each of the 9 ends differently (1/9 * 0.9 < 0.1)
    assert draft is not None and draft.tokens == common and draft.score == pytest.approx(4 * 0.9)


def test_the_corpus_stays_within_its_bytes_and_evicts_the_oldest_first():
    budget = 40_000
    drafts = Drafts("suffix", corpus_bytes=budget)
    replies = [noise(60, seed=100 + i) for i in range(40)]
    for i, reply in enumerate(replies):
        drafts.remember(f"scope-{i % 3}", reply)
        assert drafts.stats()["corpus_bytes"] <= budget
    assert 0 < drafts.stats()["corpus_entries"] < len(replies)
    newest, oldest = replies[-1], replies[0]
    assert drafts.open("scope-0", newest[:4]).propose([], 4).tokens == newest[4:8]
    assert drafts.open("scope-0", oldest[:4]).propose([], 4) is None  # evicted
    # the accounting is exact: forgetting everything brings it back to nothing
    for corpus in list(drafts.corpora.values()):
        while corpus.entries:
            corpus.evict_oldest()
        assert corpus.index.bytes == 0 and not corpus.index.positions


def test_a_scope_per_request_is_counted_with_its_fixed_cost():
    """A cache_salt that changes on every request makes a corpus per response: the budget counts each
    corpus' own objects, so what the corpora hold in memory stays near --speculative-corpus-bytes (issue 45:
    8.7 times it when only tokens, positions and keys were counted)."""
    import tracemalloc

    budget = 256 * 1024
    drafts = Drafts("suffix", corpus_bytes=budget)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2_000):
            drafts.remember(f"{i:032x}", noise(4, seed=i))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert drafts.stats()["corpus_bytes"] <= budget and drafts.stats()["scopes"] > 10
    assert held <= 1.5 * budget, f"{held:,} bytes held for a budget of {budget:,}"
    for name, corpus in list(drafts.corpora.items()):  # the accounting is exact: nothing left once all leave
        while corpus.entries:
            drafts.bytes -= corpus.nbytes(name)
            corpus.evict_oldest()
            drafts.bytes += corpus.nbytes(name)
        drafts.bytes -= corpus.nbytes(name)
    assert drafts.bytes == 0


def test_a_response_larger_than_the_budget_keeps_its_end():
    drafts = Drafts("suffix", corpus_bytes=20_000)
    reply = noise(1_000, seed=9)
    drafts.remember("s", reply)
    assert 0 < drafts.stats()["corpus_bytes"] <= 20_000
    assert drafts.open("s", reply[-10:-6]).propose([], 4).tokens == reply[-6:-2]


def test_the_draft_length_adapts_to_acceptance():
    r = Drafts("prompt", max_tokens=16).open("t", [1, 2])
    a = r.adaptation
    assert a.length == d.INITIAL_LENGTH
    r.verified(Draft([0] * 4, "prompt"), 4)
    assert a.length == d.INITIAL_LENGTH + d.GROW
    r.verified(Draft([0] * 6, "prompt"), 1)
    assert a.length == 2
    for _ in range(20):
        r.verified(Draft([0] * 16, "prompt"), 16)
    assert a.length == 16  # never past the setting


def test_a_request_whose_drafts_are_rejected_turns_itself_off():
    prompt = noise(20, seed=10) * 2
    r = Drafts("prompt").open("t", prompt)
    for _ in range(d.WARMUP_DRAFTS - 1):
        draft = r.propose([], 4)
        r.verified(draft, 0)
    assert r.active  # not before the warm-up
    r.verified(r.propose([], 4), 0)
    assert not r.active and r.propose([], 4) is None


def test_mostly_accepted_drafts_stay_on():
    prompt = noise(20, seed=11) * 2
    r = Drafts("prompt").open("t", prompt)
    for i in range(50):
        draft = r.propose([], 4)
        r.verified(draft, len(draft.tokens) if i % 4 else 0)
    assert r.active


def test_a_100k_prompt_proposes_with_work_independent_of_its_length():
    def per_call(n: int) -> tuple[int, int]:
        prompt = noise(n, seed=12, vocab=2_000)  # a small vocabulary: many repeated keys
        r = Drafts("suffix").open("t", prompt)
        opened = r.work
        output: list[int] = []
        most = 0
        for t in noise(50, seed=13, vocab=2_000):
            output.append(t)
            before = r.work
            r.propose(output, 16)
            most = max(most, r.work - before)
        return opened, most

    opened_small, small = per_call(1_000)
    opened_large, large = per_call(100_000)
    assert opened_small == opened_large == 0  # opening indexes nothing: proposals do, a chunk at a time
    # a chunk of the prompt, the candidates read, the continuation, the new token
    bound = d.INDEX_CHUNK + d.CANDIDATES * (d.MAX_MATCH + 1) + d.CANDIDATES * 16 + 1
    assert small <= bound and large <= bound


def test_a_long_prompt_is_indexed_from_its_end_and_in_the_end_whole():
    prompt = noise(10 * d.INDEX_CHUNK, seed=14)
    r = Drafts("prompt").open("t", prompt)
    early, late = prompt[:6], prompt[-40:-34]
    assert r.propose(late, 4).tokens == prompt[-34:-30]  # the recent text on the first call
    assert r.propose(late + early, 4) is None  # the start is not indexed yet
    for _ in range(10):
        r.propose(late + early, 4)
    assert r.propose(late + early, 4).tokens == prompt[6:10]


def test_an_unknown_speculative_value_is_refused_at_start():
    done = subprocess.run([sys.executable, "-m", "kvfork.server.cli", "serve", "--speculative", "fast"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--speculative" in lines[0] and "fast" in lines[0], lines
    env = dict(os.environ, KVFORK_SPECULATIVE="always")
    done = subprocess.run([sys.executable, "-m", "kvfork.server.cli", "serve"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "KVFORK_SPECULATIVE: 'always' is not one of off, prompt, suffix" in done.stderr
