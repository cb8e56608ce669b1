"""The bench's workload generator, trace loader and statistics (pure: no server)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvfork.tools.bench.client import Record
from kvfork.tools.bench.stats import output_differences, percentile, ratio, summarize
from kvfork.tools.bench.text import words
from kvfork.tools.bench.trace import TraceError, load
from kvfork.tools.bench.workload import AGENTX_CALLS, AGENTX_SESSIONS, Options, build


def test_words_gives_the_asked_count():
    for n in (1, 7, 40, 1500):
        assert len(words(random.Random(n), n).split()) == n


def test_agentx_full_scale_matches_the_seed_replay():
    wl = build("agentx-mini", Options(scale=1.0))
    assert len(wl.roots) == AGENTX_SESSIONS
    assert len(wl.calls) == AGENTX_CALLS
    assert wl.root_concurrency == 1
    assert all(16 <= c.max_tokens <= 32 for c in wl.calls)


def test_agentx_scale_shrinks_it():
    wl = build("agentx-mini", Options(scale=0.05))
    assert len(wl.roots) == 1 and 30 <= len(wl.calls) <= 40


def test_same_seed_same_prompts_other_seed_other_prompts():
    a, b = build("agentx-mini", Options(scale=0.1)), build("agentx-mini", Options(scale=0.1))
    c = build("agentx-mini", Options(scale=0.1, seed=1))
    assert [x.messages for x in a.calls] == [x.messages for x in b.calls]
    assert a.calls[0].messages != c.calls[0].messages


def test_root_calls_resend_prefix_and_growing_history():
    wl = build("agentx-mini", Options(scale=0.1, think_s=0.5))
    system = wl.calls[0].messages[0]
    for sid in wl.roots:
        calls = [c for c in wl.calls if c.session == sid]
        for prev, cur in zip(calls, calls[1:]):
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert len(cur.messages) == len(prev.messages) + 2  # the assistant's call and the tool's result
            assert (cur.after, cur.on, cur.delay_s) == (prev.id, "done", 0.5)
        assert calls[0].messages[0] == system  # the prefix is shared across sessions


def test_sub_agent_forks_from_a_running_root_call():
    wl = build("agentx-mini", Options(scale=0.1))
    by_id = {c.id: c for c in wl.calls}
    forks = [c for c in wl.calls if c.tag == "fork"]
    assert forks
    for fork in forks:
        donor = by_id[fork.after]
        assert fork.on == "first_token" and donor.session in wl.roots
        assert fork.messages[: len(donor.messages)] == donor.messages
        assert fork.session not in wl.roots  # sub-agents hold no root place


def test_burst_shares_one_prefix_and_goes_out_at_once():
    wl = build("burst", Options(n=5, prefix_tokens=300))
    assert len(wl.calls) == 5
    assert all(c.after is None and c.delay_s == 0 for c in wl.calls)
    assert len({json.dumps(c.messages[0]) for c in wl.calls}) == 1
    assert len({json.dumps(c.messages[-1]) for c in wl.calls}) == 5
    assert [c.tag for c in wl.calls] == ["lead"] + ["recipient"] * 4


def test_staggered_on_first_token_or_after_a_delay():
    wl = build("staggered", Options(n=3))
    assert [(c.after, c.on) for c in wl.calls[:3]] == [(None, "done"), ("staggered-0", "first_token"),
                                                        ("staggered-1", "first_token")]
    wl = build("staggered", Options(n=3, stagger_delay_s=0.25))
    assert [(c.after, c.on, c.delay_s) for c in wl.calls[1:3]] == [("staggered-0", "start", 0.25),
                                                                    ("staggered-1", "start", 0.25)]


def test_staggered_ends_with_each_recipients_references():
    """Each recipient's tail alone, then a fresh tail of its size over the same prefix, on the idle server."""
    wl = build("staggered", Options(n=3))
    tails, warms = wl.calls[3:5], wl.calls[5:]
    assert [(c.id, c.on, c.tag) for c in tails] == [("staggered-tail-1", "idle", "tail"),
                                                    ("staggered-tail-2", "idle", "tail")]
    assert [(c.id, c.on, c.tag) for c in warms] == [("staggered-warm-1", "idle", "warm"),
                                                    ("staggered-warm-2", "idle", "warm")]
    for i, (tail, warm) in enumerate(zip(tails, warms), start=1):
        recipient = wl.calls[i].messages
        assert tail.messages == [{"role": "system", "content": ""}, recipient[-1]]
        assert warm.messages[0] == recipient[0] and warm.messages[-1] != recipient[-1]
        assert len(warm.messages[-1]["content"].split()) == len(recipient[-1]["content"].split()) + 1


def test_presets_do_not_share_their_prefix():
    a, b = build("burst", Options()), build("staggered", Options())
    assert a.calls[0].messages[0]["content"].split()[:10] != b.calls[0].messages[0]["content"].split()[:10]


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        build("nope", Options())


def test_trace_with_messages_and_token_counts(tmp_path):
    rows = [
        {"t": 0.0, "session": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        {"t": 0.5, "session": "b", "prompt_tokens": 300, "prefix": "sys", "prefix_tokens": 200},
        {"t": 1.0, "session": "a", "prompt_tokens": 250, "prefix": "sys", "prefix_tokens": 200, "id": "x"},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    wl = load(path)
    first, second, third = wl.calls
    assert first.messages == rows[0]["messages"] and first.max_tokens == 8
    assert second.messages[0] == third.messages[0]  # same named prefix, same text
    assert len(second.messages[0]["content"].split()) == 200
    assert len(second.messages[1]["content"].split()) == 100
    assert (third.id, third.after, third.not_before_s) == ("x", first.id, 1.0)  # in session order
    assert second.after is None and second.not_before_s == 0.5


@pytest.mark.parametrize(
    "line, message",
    [("{not json", "not JSON"), ("[1]", "JSON object"), ('{"t": 0}', "needs `messages` or `prompt_tokens`"),
     ('{"prompt_tokens": 10, "prefix_tokens": 20}', "prefix_tokens <= prompt_tokens"),
     ('{"messages": "hi"}', "list of")],
)
def test_trace_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_tokens": 5}\n' + line + "\n")
    with pytest.raises(TraceError, match=f"bad.jsonl:2: .*{message}"):
        load(path)


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.random(n).tolist()
        for q in (50, 95, 99):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def _rec(cid, tag="root", ttft=1.0, prompt=100, cached=40, text="x", error=None):
    return Record(cid, "s", tag, ttft_s=ttft, e2e_s=ttft + 1, prompt_tokens=prompt, cached_tokens=cached,
                  output_tokens=5, text=text, error=error)


def test_summary_counts_only_answered_requests():
    recs = [_rec("a", "lead", 4.0), _rec("b", "recipient", 1.0), _rec("c", "recipient", 2.0),
            _rec("d", error="HTTP 500")]
    s = summarize(recs, wall_s=9.0)
    assert (s.requests, s.failed) == (4, 1)
    assert s.recipient_ttft_p50 == 1.5 and s.ttft_p50 == 2.0
    assert (s.prompt_tokens, s.cached_tokens, s.prefill_tokens, s.output_tokens) == (300, 120, 180, 15)


def test_reference_calls_stay_out_of_the_workloads_latencies():
    recs = [_rec("w-0", "lead", 4.0), _rec("w-1", "recipient", 1.0), _rec("w-2", "recipient", 3.0),
            _rec("w-tail-1", "tail", 0.5), _rec("w-tail-2", "tail", 1.0),
            _rec("w-warm-1", "warm", 0.8), _rec("w-warm-2", "warm", 2.0)]
    s = summarize(recs, wall_s=9.0)
    assert s.ttft_p50 == 3.0 and s.recipient_ttft_p50 == 2.0  # the references are not the workload's
    assert s.tail_ttft_p50 == 0.75 and s.warm_ttft_p50 == 1.4
    assert s.recipient_over_tail == 2.5  # p50 of 1.0/0.5 and 3.0/1.0
    assert s.recipient_over_warm == 1.375  # p50 of 1.0/0.8 and 3.0/2.0


def test_output_differences_and_ratio():
    base = [_rec("a", text="p"), _rec("b", text="q"), _rec("c", text="r")]
    other = [_rec("a", text="p"), _rec("b", text="Q"), _rec("c", text="zz", error="boom")]
    assert output_differences(base, other) == ["b"]
    assert ratio(1.0, 4.0) == 0.25 and ratio(None, 1.0) is None and ratio(1.0, 0) is None
