"""`generation` cancels its engine handles however its consumer leaves, even when the consumer's task
is cancelled a second time while it cleans up (aiohttp cancels a handler whose client went away)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvfork.server.generate.generation import generation


class SilentHandle:
    """An engine handle whose request never yields, and whose reader unwinds slowly when cancelled."""

    def __init__(self) -> None:
        self.done = None
        self.cancelled = False
        self.unwinding = asyncio.Event()

    def __aiter__(self) -> "SilentHandle":
        return self

    async def __anext__(self):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.unwinding.set()
            await asyncio.sleep(0.2)
            raise

    def cancel(self) -> None:
        self.cancelled = True

    def finish(self) -> None:
        pass


async def test_a_consumer_cancelled_again_during_cleanup_still_cancels_the_engine_request():
    handle = SilentHandle()
    engine = SimpleNamespace(submit=lambda request: handle)
    tokenizer = SimpleNamespace(decode=lambda ids: "")

    async def consume() -> None:
        async with generation(engine, SimpleNamespace(n=1), tokenizer, []) as events:
            async for _ in events:
                pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)  # the consumer waits for a first event
    task.cancel()  # the client went away
    await asyncio.wait_for(handle.unwinding.wait(), 5)  # the cleanup now waits on the pump
    task.cancel()  # and the handler is cancelled once more
    with pytest.raises(asyncio.CancelledError):
        await task
    assert handle.cancelled
