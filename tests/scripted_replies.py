"""A scripted backend that answers chat prompts with chosen text, through the real tokenizer.

The script sees the whole token sequence. The assistant turn being written is
everything after the last `<|im_start|>`; `reply(history)` gives the full text
that turn should read ("assistant\\n" + anything the prompt forced + the reply),
and the next token is the first token of what is still missing, then EOS. So a
forced opening (tool_choice required) or a thinking toggle in the prompt is
simply the start of the turn the script completes.
"""

from __future__ import annotations

from typing import Callable, Sequence

from scripted_backend import EOS, ScriptedBackend

IM_START = 1  # tiny_models.SPECIAL_TOKENS: <|endoftext|>, <|im_start|>, <|im_end|>


class ReplyScript:
    def __init__(self, tokenizer, reply: Callable[[str], str]):
        self.tokenizer, self.reply = tokenizer, reply

    def __call__(self, sequence: Sequence[int]) -> int:
        start = len(sequence) - 1 - list(reversed(sequence)).index(IM_START)
        history = self.tokenizer.decode(list(sequence[:start]), skip_special_tokens=False)
        written = self.tokenizer.decode(list(sequence[start + 1:]), skip_special_tokens=False)
        target = "assistant\n" + self.reply(history)
        if not target.startswith(written):
            return 3  # a prefill chunk that ends mid-prompt: its token is never used
        missing = target[len(written):]
        return self.tokenizer.encode(missing, add_special_tokens=False)[0] if missing else EOS


def scripted(model_folder: str, reply: Callable[[str], str], **backend) -> ScriptedBackend:
    from transformers import AutoTokenizer

    return ScriptedBackend(script=ReplyScript(AutoTokenizer.from_pretrained(model_folder), reply), **backend)


class RecordingScript(ReplyScript):
    """The same replies, keeping every sequence the backend samples after (a request's first one,
    once its prefill is done, is its whole prompt)."""

    def __init__(self, tokenizer, reply: Callable[[str], str]):
        super().__init__(tokenizer, reply)
        self.sequences: list[list[int]] = []

    def __call__(self, sequence: Sequence[int]) -> int:
        self.sequences.append(list(sequence))
        return super().__call__(sequence)

    def prompt(self, length: int) -> list[int]:
        """The latest prompt of `length` tokens (a request's `usage.prompt_tokens`)."""
        return next(s for s in reversed(self.sequences) if len(s) == length)

    def prompt_text(self, length: int) -> str:
        return self.tokenizer.decode(self.prompt(length), skip_special_tokens=False)


def recording(model_folder: str, reply: Callable[[str], str], **backend) -> tuple[ScriptedBackend, RecordingScript]:
    from transformers import AutoTokenizer

    script = RecordingScript(AutoTokenizer.from_pretrained(model_folder), reply)
    return ScriptedBackend(script=script, **backend), script
