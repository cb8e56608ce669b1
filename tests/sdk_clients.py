"""The OpenAI and Anthropic SDK clients a test talks to a daemon with, closed when the test ends.

An SDK client left open keeps its pooled connections; the garbage collector then closes them during
whichever later test it happens to run in, and that test sees the warnings. The `sdk` fixture
(conftest.py) hands out an `SdkClients` and closes every client it made at the test's end."""

from __future__ import annotations

import anthropic
import openai


class SdkClients:
    def __init__(self):
        self.opened: list[openai.AsyncOpenAI | anthropic.AsyncAnthropic] = []

    def openai(self, server, api_key: str = "unused", **options) -> openai.AsyncOpenAI:
        """An OpenAI client of `server` (anything with a `.url`), without retries."""
        return self._keep(openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, **options))

    def anthropic(self, server, api_key: str | None = "unused", **options) -> anthropic.AsyncAnthropic:
        """An Anthropic client of `server`, without retries."""
        return self._keep(anthropic.AsyncAnthropic(base_url=server.url, api_key=api_key, max_retries=0, **options))

    def _keep(self, client):
        self.opened.append(client)
        return client

    async def close(self) -> None:
        for client in self.opened:
            await client.close()
        self.opened.clear()
