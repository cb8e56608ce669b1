"""The prefix cache's disk tier (server/engine/cache/disk.py): restart, safety, corrupt files, the cost model.

Every test runs under its own KVFORK_HOME (conftest.py); engines here get the tier folder explicitly."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvfork.backends import create_backend
from engine_harness import collect, prompt_of, request, run, until
from kvfork.server.engine.api import Scope
from kvfork.server.engine.cache.disk import SUFFIX, kv_root
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.engine.policy.rates import Rates
from kvfork.server.engine.policy.restore import choose_restore
from kvfork.server.watch.metrics import Registry

CONFIG = dict(prefix_cache_min_tokens=8, kv_budget_bytes=1 << 30, prefix_cache_disk_bytes=1 << 30)


async def start(model: str, backend_name: str = "torch", dtype: str = "float32", **config) -> Engine:
    engine = Engine(create_backend(backend_name), model, dtype, EngineConfig(**{**CONFIG, **config}), Registry(),
                    kv_dir=kv_root())
    await engine.start()
    return engine


def files(engine_or_dir) -> list[Path]:
    folder = engine_or_dir.serving.disk.folder if isinstance(engine_or_dir, Engine) else engine_or_dir
    return sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX))


async def spill_and_stop(model: str, prompt: list[int], backend_name: str = "torch", **config) -> list[int]:
    """A daemon that computes `prompt`, then shuts down (its cache spills): its greedy tokens."""
    engine = await start(model, backend_name, **config)
    tokens, done = await run(engine, prompt, 6)
    assert done.finish_reason == "length"
    folder = engine.serving.disk.folder
    await engine.shutdown(1.0)
    assert files(folder), "the cache entry was written at shutdown"
    return tokens


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
async def test_restart_restores_an_entry_with_the_same_tokens(tiny_model_dir, arch, backend_name):
    model = tiny_model_dir(arch)
    prompt = prompt_of(80)
    fresh = await spill_and_stop(model, prompt, backend_name)
    engine = await start(model, backend_name)
    try:
        assert engine.stats().on_disk == 1  # rebuilt from the headers
        tokens, done = await run(engine, prompt, 6)
        assert done.usage.reuse_source == "disk" and done.usage.reused_tokens == len(prompt) - 1
        assert tokens == fresh
        # a longer prompt sharing it is served from it too (a prefix of the saved state)
        longer = prompt[:50] + prompt_of(30, 99)
        expected = await spill_and_stop_reference(model, longer, backend_name)
        got, done = await run(engine, longer, 6)
        assert got == expected
        assert engine.metrics.disk_restores.get(outcome="restored") >= 1
    finally:
        await engine.shutdown(1.0)


async def spill_and_stop_reference(model: str, prompt: list[int], backend_name: str) -> list[int]:
    """Greedy tokens with no reuse at all, on a separate engine without a disk tier."""
    engine = Engine(create_backend(backend_name), model, "float32",
                    EngineConfig(**{**CONFIG, "prefix_cache_entries": 0, "active_prefix_reuse_min_tokens": 0}),
                    Registry())
    await engine.start()
    try:
        return (await run(engine, prompt, 6))[0]
    finally:
        await engine.shutdown(1.0)


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
async def test_a_hybrid_model_restores_its_recurrent_state(tiny_hybrid_dir, backend_name):
    model = tiny_hybrid_dir("qwen3_5")
    prompt = prompt_of(40)
    fresh = await spill_and_stop(model, prompt, backend_name)
    engine = await start(model, backend_name)
    try:
        tokens, done = await run(engine, prompt, 6)
        assert done.usage.reuse_source == "disk" and done.usage.reused_tokens == len(prompt) - 1
        assert tokens == fresh
    finally:
        await engine.shutdown(1.0)


async def test_another_models_or_dtypes_entries_are_ignored_and_removed(tiny_model_dir):
    prompt = prompt_of(40)
    await spill_and_stop(tiny_model_dir("llama"), prompt)
    (old,) = [d for d in kv_root().iterdir()]
    for model, dtype in ((tiny_model_dir("qwen3"), "float32"), (tiny_model_dir("llama"), "bfloat16")):
        engine = await start(model, dtype=dtype)
        try:
            assert engine.stats().on_disk == 0
            assert not old.exists()  # no daemon held it: removed, and nothing outside kv/ touched
            _, done = await run(engine, prompt, 2)
            assert done.usage.reuse_source is None
        finally:
            await engine.shutdown(1.0)


async def test_two_daemons_on_one_home_never_touch_each_others_files(tiny_model_dir):
    model = tiny_model_dir("llama")
    first = await start(model)
    try:
        await run(first, prompt_of(40), 2)
        second = await start(model)
        try:
            assert not second.serving.disk.on  # the folder is locked by the first
            other = await start(tiny_model_dir("qwen3"))  # another model: may not remove a held folder
            try:
                assert first.serving.disk.folder.exists()
            finally:
                await other.shutdown(1.0)
        finally:
            await second.shutdown(1.0)
    finally:
        await first.shutdown(1.0)
    assert files(first.serving.disk.folder)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10
    path.write_bytes(bytes(data))


def _wrong_checksum(path: Path) -> None:
    data = path.read_bytes()
    at = data.index(b'"checksum":"') + len(b'"checksum":"')
    digit = b"1" if data[at:at + 1] != b"1" else b"2"
    path.write_bytes(data[:at] + digit + data[at + 1:])


@pytest.mark.parametrize("damage", [_truncate, _flip_byte, _wrong_checksum])
async def test_a_damaged_file_is_refused_removed_and_counted(tiny_model_dir, damage):
    model, prompt = tiny_model_dir("llama"), prompt_of(60)
    fresh = await spill_and_stop(model, prompt)
    (path,) = files(next(kv_root().iterdir()))
    damage(path)
    engine = await start(model)
    try:
        tokens, done = await run(engine, prompt, 6)
        assert done.error is None and done.usage.reuse_source is None  # it prefilled instead
        assert tokens == fresh
        assert not path.exists()
        assert engine.serving.disk.stats.corrupt == 1
        assert "kvfork_disk_corrupt_files_total 1" in engine.registry.render()
    finally:
        await engine.shutdown(1.0)


@pytest.mark.parametrize("error", [28, 30])  # ENOSPC (a full disk), EROFS (a read-only folder)
async def test_a_full_disk_or_read_only_folder_turns_the_tier_off_once(tiny_model_dir, monkeypatch, caplog, error):
    from kvfork.server.engine.cache import disk

    def refuse(folder, name, data):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(disk, "_write_file", refuse)
    # one entry in memory: each new prompt evicts the last, which spills
    engine = await start(tiny_model_dir("llama"), prefix_cache_entries=1)
    try:
        for i in range(4):
            _, done = await run(engine, prompt_of(30, i * 50), 2)
            assert done.error is None
        await until(lambda: engine.stats().spilling == 0)
        assert not engine.stats().disk_on
        warnings = [r for r in caplog.records if "disk tier off" in r.getMessage()]
        assert len(warnings) == 1
        _, done = await run(engine, prompt_of(30, 999), 2)  # serving goes on
        assert done.finish_reason == "length"
    finally:
        await engine.shutdown(1.0)


async def test_a_read_only_folder_at_start_leaves_the_tier_off(tiny_model_dir, monkeypatch, caplog):
    from kvfork.server.engine.cache import disk

    def refuse(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(disk, "_try_lock", refuse)
    engine = await start(tiny_model_dir("llama"))
    try:
        assert not engine.stats().disk_on
        assert len([r for r in caplog.records if "disk tier off" in r.getMessage()]) == 1
        _, done = await run(engine, prompt_of(30), 2)
        assert done.finish_reason == "length"
    finally:
        await engine.shutdown(1.0)


def test_the_cost_model_restores_only_when_reading_beats_prefilling():
    fast_disk = Rates(prefill_tps=1000.0, clone_fixed_s=0.0, clone_s_per_token=0.0, read_bps=1e9)
    slow_disk = Rates(prefill_tps=1000.0, clone_fixed_s=0.0, clone_s_per_token=0.0, read_bps=1e6)
    # 2,000 tokens of 40 MB: 0.04 s to read at 1 GB/s, 40 s at 1 MB/s; 2 s to prefill
    assert choose_restore(2000, 40_000_000, 0, fast_disk, 0).restore
    slow = choose_restore(2000, 40_000_000, 0, slow_disk, 0)
    assert not slow.restore and slow.reason == "slower"
    # what memory already holds is not prefilled either way: only the rest counts
    assert not choose_restore(2000, 40_000_000, 1990, fast_disk, 0).restore
    # prefilling beside others is slower (a share of the rate): the disk wins sooner
    assert choose_restore(2000, 2_000_000_000, 0, fast_disk, 3).restore
    assert not choose_restore(2000, 2_000_000_000, 0, fast_disk, 0).restore
    assert not choose_restore(100, 1, 100, fast_disk, 0).restore  # nothing to gain


@pytest.mark.parametrize("read_bps, restored", [(1e12, True), (1.0, False)])
async def test_the_engine_follows_the_cost_model(tiny_model_dir, read_bps, restored):
    from kvfork.server.engine.policy.rates import RateTracker

    model, prompt = tiny_model_dir("llama"), prompt_of(80)
    fresh = await spill_and_stop(model, prompt)
    engine = await start(model)
    try:
        engine.rates = RateTracker(prior=Rates(read_bps=read_bps))  # a simulated disk, fast or slow
        tokens, done = await run(engine, prompt, 6)
        assert tokens == fresh
        assert (done.usage.reuse_source == "disk") is restored
        choice = "restore" if restored else "slower"
        assert engine.metrics.disk_decisions.get(choice=choice) == 1
    finally:
        await engine.shutdown(1.0)


async def test_a_slow_restore_never_stalls_a_running_request(tiny_model_dir, monkeypatch):
    import threading

    from kvfork.server.engine.cache import disk

    model, cached, other = tiny_model_dir("llama"), prompt_of(80), prompt_of(40, 300)
    fresh = await spill_and_stop(model, cached)
    alone = await spill_and_stop_reference(model, other, "torch")
    gate = threading.Event()
    reading = threading.Event()
    real = disk.decode

    def slow_decode(data, fp):  # a disk that answers only when the test lets it
        reading.set()
        assert gate.wait(60)
        return real(data, fp)

    monkeypatch.setattr(disk, "decode", slow_decode)
    engine = await start(model)
    try:
        # a disk that reads and loads in no time, so the restore is chosen whatever prefill rate `running`
        # measures on this machine (a fast CPU prefills 80 tokens in less than a clone's fixed 2 ms)
        engine.rates = engine.rates.__class__(prior=Rates(read_bps=1e12, clone_fixed_s=0.0, clone_s_per_token=0.0))
        runner_tokens: list[int] = []
        running = engine.submit(request(other, 40, rid="running", ignore_eos=True))

        async def read_running():
            from kvfork.server.engine.api import TokenEvent
            async for event in running:
                if isinstance(event, TokenEvent):
                    runner_tokens.append(event.token)
        reader = asyncio.create_task(read_running())
        await until(lambda: len(runner_tokens) >= 2)
        restoring = engine.submit(request(cached, 6, rid="restoring"))
        assert await asyncio.to_thread(reading.wait, 30)
        before = len(runner_tokens)
        await until(lambda: len(runner_tokens) >= before + 5, timeout=60)  # decoding goes on meanwhile
        gate.set()
        tokens, done = await collect(restoring)
        await reader
        assert done.usage.reuse_source == "disk" and tokens == fresh
        assert runner_tokens[:6] == alone[:6] and len(runner_tokens) == 40
    finally:
        gate.set()
        await engine.shutdown(1.0)


def test_bfloat16_states_round_trip_through_a_file(tiny_model_dir):
    import numpy as np

    from kvfork.server.engine.cache.disk import decode, encode

    backend = create_backend("torch")
    backend.load(tiny_model_dir("gemma3"), "bfloat16")
    session = backend.open_session()
    backend.prefill([session], [prompt_of(70)])
    state = backend.export_state(session)
    data = encode(state, prompt_of(70), "scope-digest", "fp")
    back, tokens, _ = decode(data, "fp")
    assert tokens == prompt_of(70) and back.position == 70
    # every tensor is named by its layer, kind and token range (a block later is another range)
    assert b"layers.0.sliding.0." in data and b"-70" in data
    restored = backend.import_state(back)
    logits = [backend.to_numpy(backend.prefill([s], [[5]])) for s in (session, restored)]
    np.testing.assert_array_equal(logits[0], logits[1])


def test_a_states_m_rope_shifts_round_trip_through_a_file_and_a_prefix():
    """Where M-RoPE's next position is not the slot (after an image, backends/torch/images.py) travels with the
    state: through a disk file, and cut to what a prefix holds."""
    import numpy as np

    from kvfork.backends.base import SavedLayer, SavedState
    from kvfork.server.engine.cache.disk import decode, encode

    keys = np.zeros((1, 40, 2), np.float32)
    state = SavedState(40, (SavedLayer("full", (keys, keys)),), ((12, -3), (30, -5)))
    back, _, _ = decode(encode(state, list(range(40)), "scope-digest", "fp"), "fp")
    assert back.rope_shifts == ((12, -3), (30, -5))
    assert state.prefix(20).rope_shifts == ((12, -3),)


async def test_a_spill_holds_its_bytes_until_its_file_is_written(tiny_model_dir, monkeypatch):
    import threading

    from kvfork.server.engine.cache import disk

    gate, writing = threading.Event(), threading.Event()
    real = disk._write_file

    def slow_write(folder, name, data):
        writing.set()
        assert gate.wait(60)
        real(folder, name, data)

    monkeypatch.setattr(disk, "_write_file", slow_write)
    model = tiny_model_dir("llama")
    probe = await start(model)
    kv = probe.info.kv
    await probe.shutdown(1.0)
    # room for a request of 60 + 4 tokens and its capture; a longer one needs the cached entry's room too
    budget = kv.bytes_for(64, start=59) + kv.bytes_for(60, start=60)
    assert budget - kv.bytes_for(60, start=60) < kv.bytes_for(304, start=299) <= budget
    engine = await start(model, kv_budget_bytes=budget, inference_slots=1)
    try:
        await run(engine, prompt_of(60), 4)  # its snapshot stays in the cache
        second = engine.submit(request(prompt_of(300, 400), 4, rid="second"))
        assert await asyncio.to_thread(writing.wait, 30)  # the first entry is spilling...
        stats = engine.stats()
        assert stats.spilling > 0 and stats.held <= stats.budget
        assert stats.queued == 1  # ...and the second waits for its bytes
        gate.set()
        tokens, done = await collect(second)
        assert done.finish_reason == "length" and engine.stats().spilling == 0
        assert engine.stats().on_disk == 1
    finally:
        gate.set()
        await engine.shutdown(1.0)


async def test_a_longer_prompt_replaces_the_files_of_prompts_it_begins_with(tiny_model_dir):
    model, short = tiny_model_dir("llama"), prompt_of(40)
    longer = short + prompt_of(30, 77)
    engine = await start(model, prefix_cache_entries=1)  # each new prompt spills the last
    try:
        await run(engine, short, 2)
        await run(engine, longer, 2)  # spills `short`
        await run(engine, prompt_of(50, 900), 2)  # spills `longer`, which replaces `short`'s file
        await until(lambda: engine.stats().spilling == 0 and engine.stats().on_disk == 1)
        await until(lambda: len(files(engine)) == 1)
        (entry,) = engine.serving.index.entries("disk")
        assert entry.tokens == tuple(longer)
        assert not engine.serving.disk.worth(short, engine.serving.index.digest(Scope()))  # served by the longer file
        tokens, done = await run(engine, short, 4)  # the same prompt comes back from the longer file
        assert done.usage.reuse_source == "disk" and done.usage.reused_tokens == len(short) - 1
    finally:
        await engine.shutdown(1.0)
