"""The model's tokenizer and chat template, kept off the event loop when the work is long.

BOS rule: a chat template that wants a BOS writes it, so rendered chat text is
encoded without special tokens; raw completion text gets the tokenizer's usual
special tokens unless it already starts with the BOS string. Either way a
prompt never carries two.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from server.errors import ApiError

# Prompts longer than this (characters) are tokenized on the worker thread: a
# few thousand characters take well under a millisecond, so shorter ones stay
# on the loop and skip the thread hop.
_OFF_LOOP_CHARS = 4096


class PromptTokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.bos_token: str | None = tokenizer.bos_token
        # One worker: the Rust tokenizer is not meant for concurrent encodes.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfork-tokenize")

    @classmethod
    def load(cls, folder: str) -> "PromptTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(folder))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
        size = sum(len(str(m.get("content") or "")) for m in messages) + len(str(tools or ""))
        return await self._run(size, self.encode_chat, messages, tools, template_kwargs or {})

    async def text(self, text: str) -> list[int]:
        return await self._run(len(text), self.encode_text, text)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                    template_kwargs: dict[str, Any]) -> list[int]:
        kwargs = {k: v for k, v in template_kwargs.items() if k not in ("tokenize", "add_generation_prompt")}
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as e:  # jinja raises its own errors for histories a template rejects
            raise ApiError(400, f"the chat template rejected the messages: {e}", code="invalid_value",
                           param="messages") from None
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        starts_with_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.tokenizer.encode(text, add_special_tokens=not starts_with_bos)

    def decode(self, tokens: Sequence[int]) -> str:
        # No clean-up: it rewrites text already streamed (" ." -> "."), which
        # would break the incremental detokenizer's prefix rule.
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_text(self, token: int) -> str:
        """One token's own text, for logprobs (special tokens included)."""
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    async def _run(self, size: int, fn, *args):
        if size <= _OFF_LOOP_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
