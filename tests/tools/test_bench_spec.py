"""`kvfork bench spec`'s parts: its workloads, and the offline acceptance replay."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from kvfork.server.engine.worker.drafts import Drafts
from kvfork.tools.bench import main, paired, spec
from kvfork.tools.bench.spec_replay import replay_one
from kvfork.tools.bench.spec_workloads import WORKLOADS, code_file, jobs

SIZES = dict(code_lines=150, code_tokens=2400, agent_tokens=64, prose_tokens=256)


def test_a_reply_that_restates_the_prompt_takes_fewer_steps_than_tokens():
    rng = random.Random(0)
    body = [rng.randrange(100, 5000) for _ in range(300)]
    counts, steps = replay_one(Drafts("prompt"), "s", [1, 2, *body, 3], body, 16)
    drafted, accepted = counts["prompt"]
    assert 0 < accepted <= drafted and steps < len(body) // 4
    # every step commits its accepted run and one token more: together, the reply after its first token
    assert steps + accepted >= len(body) - 1


def test_a_reply_with_nothing_to_copy_drafts_nothing_and_steps_once_a_token():
    rng = random.Random(1)
    prompt, reply = [rng.randrange(100, 50_000) for _ in range(200)], [rng.randrange(100, 50_000) for _ in range(50)]
    counts, steps = replay_one(Drafts("suffix"), "s", prompt, reply, 16)
    assert counts == {} and steps == len(reply) - 1


def test_the_suffix_corpus_carries_one_reply_into_the_next_of_its_scope():
    rng = random.Random(2)
    reply = [rng.randrange(100, 50_000) for _ in range(80)]
    drafts = Drafts("suffix")
    replay_one(drafts, "s", [5, 6, 7], reply, 16)
    counts, steps = replay_one(drafts, "s", [8, 9, 10], reply, 16)
    assert counts["suffix"][1] > 60 and steps < 20


def test_the_workloads_are_seeded_and_the_code_file_is_about_150_lines():
    text, names = code_file(random.Random(0), 150)
    assert 150 <= len(text.splitlines()) < 170 and len(names) > 5
    for name in WORKLOADS:
        first, again, other = (jobs(name, seed, 4, **SIZES) for seed in (1, 1, 2))
        assert len(first) == 4 and first == again and first != other


def test_the_table_reports_medians_spread_speedup_and_acceptance_of_each_mode():
    result = {"names": ["code-edit"], "levels": [1],
              "speed": {"code-edit|1|off": [10.0, 12.0, 11.0], "code-edit|1|prompt": [9.0, 11.0, 10.0],
                        "code-edit|1|suffix": [20.0, 22.0, 24.0]},
              "offline": {"code-edit": {"prompt": {"drafted": 10, "accepted": 8, "acceptance": 0.8,
                                                    "tokens_per_step": 3.0}}},
              "served": {"code-edit|suffix": {"drafted:suffix": 50.0, "accepted:suffix": 25.0}}}
    md = spec.table(result, ["prompt", "suffix"])
    assert "| code-edit | 1 | 11.0 (10.0-12.0) | 10.0 (9.0-11.0) | 0.91x | 22.0 (20.0-24.0) | 2.00x |" in md
    assert "| code-edit (offline) | prompt | 10 | 8 | 80% | 3.00 |" in md
    assert "| code-edit (served, suffix) | suffix | 50 | 25 | 50% | |" in md


def test_the_reference_replies_are_the_file_with_the_edit_and_the_scripts_next_turn():
    (edit,) = jobs("code-edit", 3, 1, **SIZES)
    asked, reference = edit.messages[0]["content"], edit.reference
    old = asked.split("Rename the function `")[1].split("`")[0]
    assert f"def {old}_v2(" in reference and f"def {old}(" not in reference
    changed = [b for a, b in zip(asked.split("```python\n")[1].splitlines(), reference.splitlines()[1:]) if a != b]
    assert len(changed) == 2 and any("limit: int = 128" in line for line in changed)
    calls = jobs("agent", 3, 4, **SIZES)
    assert calls[0].reference.startswith("Calling tool_") and calls[0].reference in calls[1].messages[-2]["content"]


def test_a_run_against_three_daemons_reverses_their_order_and_reports_every_workload(tiny_model_dir, tmp_path,
                                                                                    monkeypatch, capsys):
    monkeypatch.setattr(paired, "DAEMON", [sys.executable, str(Path(__file__).parents[1] / "openai_double.py")])
    out = tmp_path / "out"
    code = main(["spec", "--model", tiny_model_dir("llama"), "--runs", "2", "--concurrency", "1,2", "--code-lines",
                 "20", "--code-tokens", "24", "--agent-tokens", "8", "--prose-tokens", "8",
                 "--speculative", "prompt,suffix", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    for name in ("code-edit", "agent", "prose"):
        for c in (1, 2):
            assert f"| {name} | {c} | " in printed.out
        assert f"| {name} (offline) |" in printed.out
    # runs reverse the daemons' order
    order = [line.rsplit(" ", 3)[-3].rstrip(":") for line in printed.err.splitlines() if " code-edit c=1 " in line]
    assert order == ["off", "prompt", "suffix", "suffix", "prompt", "off"]
    doc = json.loads((out / "results.json").read_text())
    assert all(len(v) == 2 for v in doc["speed"].values()) and len(doc["speed"]) == 18
