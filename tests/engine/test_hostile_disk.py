"""The disk tier against what a hostile local user or a damaged disk can do (issue 22's findings 2, 7 and 11):
a malformed file never keeps the daemon from starting, files tell nothing to other users, and the last spills
at shutdown land."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import stat
import shutil
import struct

import pytest

from engine_harness import prompt_of, request, collect, run
from kvfork.server.engine.api import Scope
from kvfork.server.engine.cache import disk
from test_disk_tier import files, start

WRONG = [b"[]", json.dumps({"__metadata__": None}).encode(), json.dumps({"__metadata__": [1]}).encode()]


def _header_file(meta: dict) -> bytes:
    header = json.dumps({"__metadata__": meta}).encode()
    return struct.pack("<Q", len(header)) + header


@pytest.mark.parametrize("case", range(len(WRONG) + 3))
async def test_a_malformed_file_is_removed_counted_and_never_blocks_start(tiny_model_dir, case):
    model = tiny_model_dir("llama")
    probe = await start(model)  # the tier's folder, and what a well-formed header says
    folder, fp = probe.serving.disk.folder, probe.serving.disk.fp
    await probe.shutdown(1.0)
    base = {"kvfork_kv": disk.KV_FORMAT_VERSION, "fingerprint": fp, "position": "3", "scope": "x", "layers": "[]"}
    contents = WRONG + [_header_file({**base, "tokens": "5"}), _header_file({**base, "tokens": '["a"]'}),
                        _header_file({**base, "tokens": "[1,2,3]", "scope": 7})]
    path = folder / ("ab" * 20 + disk.SUFFIX)
    path.write_bytes(contents[case])
    engine = await asyncio.wait_for(start(model), 120)  # on main: never ready (503 forever)
    try:
        assert engine.ready and engine.stats().disk_on
        assert not path.exists()
        assert "kvfork_disk_corrupt_files_total 1" in engine.registry.render()
        _, done = await run(engine, prompt_of(20), 2)
        assert done.finish_reason == "length"
    finally:
        await engine.shutdown(1.0)


async def test_files_are_private_and_name_their_scope_by_a_keyed_hash(tiny_model_dir, kvfork_home):
    model = tiny_model_dir("llama")
    engine = await start(model)
    scope = Scope("tenant-a", "salt")
    try:
        await run(engine, prompt_of(40), 2, scope=scope)
        folder = engine.serving.disk.folder
    finally:
        await engine.shutdown(1.0)
    (path,) = files(folder)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(path) == 0o600 and mode(folder / disk.LOCK) == 0o600
    assert mode(folder) == 0o700 and mode(folder.parent) == 0o700
    secret = kvfork_home / disk.SECRET
    assert mode(secret) == 0o600 and len(secret.read_bytes()) == 32
    named = disk.read_header(path)["scope"]
    guessable = hashlib.sha256(json.dumps([scope.tenant, scope.salt]).encode()).hexdigest()[:32]
    assert named != guessable and named == scope.digest(secret.read_bytes())
    # a restart under the same secret finds it again, in its own scope only
    engine = await start(model)
    try:
        _, done = await run(engine, prompt_of(40), 2, scope=scope)
        assert done.usage.reuse_source == "disk"
        _, done = await run(engine, prompt_of(40), 2, scope=Scope("tenant-b", "salt"))
        assert done.usage.reuse_source is None
    finally:
        await engine.shutdown(1.0)


async def one_file(model: str):
    """(the tier's folder, its one file): a daemon that computed one prompt, stopped (its cache spilled)."""
    engine = await start(model)
    await run(engine, prompt_of(40), 2)
    await engine.shutdown(1.0)
    (path,) = files(engine.serving.disk.folder)
    return engine.serving.disk.folder, path


async def test_older_loose_permissions_are_narrowed_at_start(tiny_model_dir):
    model = tiny_model_dir("llama")
    folder, path = await one_file(model)
    for p, loose in ((path, 0o644), (folder / disk.LOCK, 0o644), (folder, 0o755)):
        p.chmod(loose)
    engine = await start(model)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE((folder / disk.LOCK).stat().st_mode) == 0o600
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    finally:
        await engine.shutdown(1.0)


async def test_the_spill_at_shutdown_lands_before_the_pool_closes(tiny_model_dir, caplog):
    """P, P + 100 and P + 200 tokens in one scope, all in memory, then shutdown: the longest file replaces
    the other two, and nothing is scheduled on a closed pool."""
    model = tiny_model_dir("llama")
    engine = await start(model)
    p = prompt_of(40)
    with caplog.at_level(logging.WARNING):
        for extra in (0, 100, 200):
            tokens, done = await collect(engine.submit(request(p + prompt_of(extra, 300), 2)))
            assert done.finish_reason == "length"
        folder = engine.serving.disk.folder
        await engine.shutdown(1.0)
    assert [disk.read_header(f)["tokens"] for f in files(folder)] == [json.dumps(p + prompt_of(200, 300))]
    assert not [r for r in caplog.records if "after shutdown" in r.getMessage() or r.exc_info]


# ---- issue 33, finding 18: no link is followed ----


def test_cache_clear_never_follows_a_link(kvfork_home, tmp_path, capsys):
    from kvfork.server.launch.cache_command import main

    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / ("ab" * 20 + disk.SUFFIX)
    victim.write_bytes(b"not the tier's")
    (outside / disk.LOCK).write_bytes(b"")
    root = disk.kv_root()
    root.mkdir(mode=0o700, parents=True)
    (root / "linked").symlink_to(outside, target_is_directory=True)
    ours = root / ("f" * 20)
    ours.mkdir(mode=0o700)
    (ours / ("cd" * 20 + disk.SUFFIX)).write_bytes(b"x")
    (ours / ("ef" * 20 + disk.SUFFIX)).symlink_to(victim)  # a link among the entries: removed itself
    assert main(["clear"]) == 0
    assert victim.read_bytes() == b"not the tier's" and (root / "linked").is_symlink()
    assert not ours.exists() or not list(ours.iterdir())
    assert all(f["fingerprint"] != "linked" for f in disk.describe(root))
    # the kv folder itself a link: refused, nothing removed
    shutil.rmtree(root)
    root.symlink_to(outside, target_is_directory=True)
    try:
        assert main(["clear"]) == 1 and victim.exists()
        assert "not cleared" in capsys.readouterr().out
    finally:
        root.unlink()


async def test_the_tier_follows_no_link_in_its_folder(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    folder, path = await one_file(model)
    outside = tmp_path / "private.safetensors"
    outside.write_bytes(path.read_bytes())  # a valid file, elsewhere
    outside.chmod(0o640)
    path.unlink()
    path.symlink_to(outside)
    engine = await start(model)
    try:
        assert engine.stats().disk_on and not path.exists() and not path.is_symlink()  # the link removed, alone
        assert stat.S_IMODE(outside.stat().st_mode) == 0o640 and outside.exists()  # never chmodded
        _, done = await run(engine, prompt_of(40), 2)
        assert done.usage.reuse_source != "disk"  # never read through the link
    finally:
        await engine.shutdown(1.0)
    # a link in place of the lock file: the tier is off rather than chmod what it points to
    (folder / disk.LOCK).unlink()
    (folder / disk.LOCK).symlink_to(outside)
    engine = await start(model)
    try:
        assert not engine.stats().disk_on and stat.S_IMODE(outside.stat().st_mode) == 0o640
    finally:
        await engine.shutdown(1.0)
    (folder / disk.LOCK).unlink()


@pytest.mark.parametrize("bad", ["empty", "short", "link"])
async def test_a_bad_secret_is_replaced_with_a_warning(tiny_model_dir, kvfork_home, tmp_path, caplog, bad):
    model = tiny_model_dir("llama")
    secret = kvfork_home / disk.SECRET
    outside = tmp_path / "someone-elses"
    outside.write_bytes(b"s" * 32)
    outside.chmod(0o644)
    secret.unlink(missing_ok=True)
    if bad == "link":
        secret.symlink_to(outside)
    else:
        secret.write_bytes(b"" if bad == "empty" else b"x" * 5)
    with caplog.at_level(logging.WARNING, logger="kvfork.private"):
        engine = await start(model)
    try:
        assert engine.serving.disk is not None and engine.stats().disk_on
        assert any("replacing the secret" in r.getMessage() for r in caplog.records)
        assert not secret.is_symlink() and len(secret.read_bytes()) == 32 and secret.read_bytes() != b"s" * 32
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert stat.S_IMODE(outside.stat().st_mode) == 0o644 and outside.read_bytes() == b"s" * 32
    finally:
        await engine.shutdown(1.0)


def test_two_daemons_making_the_secret_at_once_agree(kvfork_home):
    from concurrent.futures import ThreadPoolExecutor

    (kvfork_home / disk.SECRET).unlink(missing_ok=True)
    with ThreadPoolExecutor(8) as pool:
        secrets = list(pool.map(lambda _: disk.tier_secret(disk.kv_root()), range(16)))
    assert len(set(secrets)) == 1 and len(secrets[0]) == 32
    assert not list(kvfork_home.glob(".kv-secret*"))  # no temporary left behind
