"""Token ids in, text out, one token at a time, never a broken character.

Decoding a token alone is wrong: byte-level BPE splits a character over tokens,
and SentencePiece drops a word's leading space. So each step decodes a short
window of recent tokens twice, with and without the new ones, and releases only
the difference. A window that ends in U+FFFD holds its bytes back until the next
token completes the character. The window start moves up once text is released,
so the cost per token stays constant however long the answer grows.
"""

from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

# Tokens kept before the released point, so the decoder sees enough context to
# place spaces right (SentencePiece) and to join a split character.
_CONTEXT = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Decode):
        self.decode = decode
        self.tokens: list[int] = []
        self.start = 0  # window start: context for the decoder
        self.released = 0  # tokens whose text has been handed out

    def add(self, token: int) -> str:
        """Append one token; return the text it completes (possibly "")."""
        self.tokens.append(token)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end: whatever is still held back, even an incomplete character."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        before = self.decode(self.tokens[self.start : self.released])
        after = self.decode(self.tokens[self.start :])
        if not final and after.endswith(_REPLACEMENT):
            return ""  # an incomplete character: wait for the bytes that finish it
        if not after.startswith(before):
            # The decoder rewrote text already released (a normalizer did); that
            # cannot be taken back, so release the new tokens decoded alone.
            text, self.start = self.decode(self.tokens[self.released :]), len(self.tokens)
            self.released = len(self.tokens)
            return text
        self.released = len(self.tokens)
        self.start = max(self.start, self.released - _CONTEXT)
        return after[len(before) :]
