"""The daemon's text layer: incremental detokenizing and stop strings."""

from __future__ import annotations

import random

import pytest

from kvfork.server.text.detokenizer import IncrementalDetokenizer
from kvfork.server.text.stops import StopMatcher
from kvfork.server.text.tokenizer import PromptTokenizer


def stream(detok: IncrementalDetokenizer, tokens: list[int]) -> list[str]:
    return [detok.add(t) for t in tokens] + [detok.flush()]


@pytest.mark.parametrize("text", ["the cache of Paris 1234.", "héllo wörld — ça va? 日本語のテキスト 🎉🚀 end"])
def test_incremental_text_equals_full_decode(tokenizer, text):
    tokens = tokenizer.encode_text(text)
    pieces = stream(IncrementalDetokenizer(tokenizer.decode), tokens)
    assert "".join(pieces) == tokenizer.decode(tokens) == text


def test_never_splits_a_utf8_character(tokenizer):
    text = "🎉日本🚀é" * 5
    tokens = tokenizer.encode_text(text)
    assert len(tokens) > len(text)  # the tiny vocab splits these characters over byte tokens
    pieces = stream(IncrementalDetokenizer(tokenizer.decode), tokens)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_long_output_keeps_a_short_window(tokenizer):
    tokens = tokenizer.encode_text("the prefix cache of the server " * 200)
    detok = IncrementalDetokenizer(tokenizer.decode)
    for t in tokens:
        detok.add(t)
        assert detok.released - detok.start <= 6


def test_special_tokens_are_not_streamed(tokenizer):
    end = tokenizer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens = tokenizer.encode_text("the answer") + [end]
    assert "".join(stream(IncrementalDetokenizer(tokenizer.decode), tokens)) == "the answer"


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        m = matcher.feed(piece)
        out.append(m.text)
        if m.stopped:
            return out, True
    return out + [matcher.flush()], False


def test_stop_string_split_across_pieces_is_never_streamed():
    out, stopped = feed_all(StopMatcher(["STOP"]), ["hello S", "T", "O", "P and more"])
    assert stopped and "".join(out) == "hello "
    assert out == ["hello ", "", "", ""]  # "S", "ST", "STO" held until ruled in


def test_held_text_released_when_ruled_out():
    out, stopped = feed_all(StopMatcher(["STOP"]), ["a ST", "ART b"])
    assert not stopped and out == ["a ", "START b", ""]


def test_held_text_flushed_at_the_end():
    out, stopped = feed_all(StopMatcher(["</end>"]), ["x </e"])
    assert not stopped and "".join(out) == "x </e"


def test_earliest_stop_string_wins():
    out, stopped = feed_all(StopMatcher(["world", "lo w"]), ["hello world"])
    assert stopped and out == ["hel"]


def test_no_stop_strings_pass_through():
    assert feed_all(StopMatcher([]), ["a", "b"]) == (["a", "b", ""], False)


def test_random_splits_agree_with_a_whole_search():
    rng = random.Random(0)
    stops = ["\n\n", "Observation:", "</tool>", "ab"]
    for _ in range(300):
        text = "".join(rng.choice(["a", "b", "\n", "Obs", "ervation:", "</to", "ol>", "x ", "é"]) for _ in range(20))
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out, stopped = feed_all(StopMatcher(stops), pieces)
        first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        assert stopped == (first >= 0)
        assert "".join(out) == (text[:first] if first >= 0 else text)
