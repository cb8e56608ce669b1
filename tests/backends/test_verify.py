"""Backend.verify and Backend.truncate (speculative decoding's two verbs): a decode row carrying
drafted tokens reads every position's logits in one pass, and a session rolled back past the
rejected ones decodes on exactly as one that never saw them, on both backends and every
architecture that rolls back (a hybrid says it cannot)."""

from __future__ import annotations

import pytest

from backend_fixtures import assert_close, backend_name, load, logits_np  # noqa: F401 (a fixture)
from tiny_hybrid_models import HYBRID_ARCHS
from tolerance import Kind

ARCHS = ["llama", "qwen3", "gemma3"]


def reference(b, prompt: list[int], steps: int):
    """Greedy tokens and each position's logits, decoding one token a call."""
    s = b.open_session()
    logits = [logits_np(b, b.prefill([s], [prompt]))[0]]
    picks = []
    for _ in range(steps):
        picks.append(int(logits[-1].argmax()))
        logits.append(logits_np(b, b.decode([s], [picks[-1]]))[0])
    b.release(s)
    return picks, logits


@pytest.mark.numeric
@pytest.mark.parametrize("arch", ARCHS)
def test_verify_then_truncate_decodes_as_without_drafts(backend_name, arch, tiny_model_dir):
    b = load(backend_name, tiny_model_dir(arch))
    if not b.rolls_back:
        pytest.skip(f"{backend_name} does not roll {arch} back (it says so: rolls_back)")
    prompt = list(range(5, 25))  # gemma3's window is 16: the drafts cross it
    picks, want = reference(b, prompt, 24)
    s = b.open_session()
    b.prefill([s], [prompt])
    at, steps = 0, 0  # picks[at] is the committed token the next row feeds
    while at < 20:
        good = picks[at + 1:at + 3]
        draft = good + [(picks[at + 3] + 1) % 500, 7]  # two right, then two wrong
        out = logits_np(b, b.verify([s], [[picks[at], *draft]], [len(draft) + 1]))
        assert out.shape[0] == len(draft) + 1
        for j, row in enumerate(out[:3]):
            assert_close(b, row, want[at + 1 + j], Kind.BATCHED, context=len(prompt) + at + j + 1)
        b.truncate(s, len(prompt) + at + 3)  # keep the committed token and the two right drafts
        assert s.position == len(prompt) + at + 3
        at, steps = at + 3, steps + 1
    after = logits_np(b, b.decode([s], [picks[at]]))[0]  # one plain decode after the last roll back
    assert_close(b, after, want[at + 1], Kind.BATCHED, context=len(prompt) + at + 1)
    b.release(s)


@pytest.mark.numeric
def test_rows_of_one_verify_call_read_and_roll_back_as_each_alone(backend_name, tiny_model_dir, monkeypatch):
    """Drafted rows of several lengths and plain rows in one verify call (one pass: on MLX the decode
    batch's step, each row padded to the longest) give each row the logits it has alone, each rolled
    back by its own count decodes on as without drafts, and a clone of one holds only what it kept.
    The padding the rows forget is cut early here (COMPACT_PADDING), so the cut runs too."""
    monkeypatch.setattr("kvfork.backends.mlx.batch.COMPACT_PADDING", 3)
    b = load(backend_name, tiny_model_dir("llama"))
    prompts = [list(range(5, 25)), list(range(40, 52)), list(range(100, 131))]
    refs = [reference(b, p, 64) for p in prompts]
    sessions = [b.open_session() for _ in prompts]
    for s, p in zip(sessions, prompts):
        b.prefill([s], [p])
    at = [0] * len(prompts)  # refs[i][0][at[i]] is the committed token row i feeds next
    for step in range(12):
        chunks, right = [], []
        for i, ((picks, _), a) in enumerate(zip(refs, at)):
            drafted = (step + i) % 5  # 0: a plain row
            good = min(drafted, (step * (i + 1)) % 4)
            wrong = (picks[a + 1 + good] + 1) % 500
            chunks.append([picks[a], *picks[a + 1:a + 1 + good], *[wrong] * (drafted - good)])
            right.append(good)
        out = logits_np(b, b.verify(sessions, chunks, [len(c) for c in chunks]))
        assert out.shape[0] == sum(len(c) for c in chunks)
        first = 0
        for s, p, (_, want), a, chunk, good in zip(sessions, prompts, refs, at, chunks, right):
            for j in range(good + 1):
                assert_close(b, out[first + j], want[a + 1 + j], Kind.BATCHED, context=len(p) + a + j + 1)
            first += len(chunk)
            b.truncate(s, len(p) + a + good + 1)  # the committed token and the right drafts
        at = [a + good + 1 for a, good in zip(at, right)]
    out = logits_np(b, b.decode(sessions, [picks[a] for (picks, _), a in zip(refs, at)]))
    for row, p, (_, want), a in zip(out, prompts, refs, at):
        assert_close(b, row, want[a + 1], Kind.BATCHED, context=len(p) + a + 1)
    clone = b.clone(sessions[0], sessions[0].position)
    picks, want = refs[0]
    after = logits_np(b, b.decode([clone], [picks[at[0] + 1]]))[0]
    assert_close(b, after, want[at[0] + 2], Kind.BATCHED, context=len(prompts[0]) + at[0] + 2)
    for s in [*sessions, clone]:
        b.release(s)


def test_truncate_refuses_what_it_cannot_undo(backend_name, tiny_model_dir):
    b = load(backend_name, tiny_model_dir("llama"))
    if not b.rolls_back:
        pytest.skip("no roll back on this backend")
    s = b.open_session()
    b.prefill([s], [list(range(3, 12))])
    with pytest.raises(ValueError):
        b.truncate(s, s.position + 1)
    with pytest.raises(ValueError):
        b.verify([s], [[3, 4]], [3])  # reads more positions than the row has
    b.release(s)


def test_a_hybrid_does_not_roll_back(backend_name, tiny_hybrid_dir):
    b = load(backend_name, tiny_hybrid_dir(HYBRID_ARCHS[0]))
    assert not b.rolls_back
    s = b.open_session()
    with pytest.raises(ValueError):
        b.verify([s], [[3, 4]], [2])
    b.release(s)
