"""KV events in vLLM's format (server/watch/kv_events.py): the ledger's announcements, the chained hashes, and the
wire, decoded by a real ZMQ subscriber with structs written here from vLLM's published definitions (field
order matters in msgpack arrays), replay included."""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

import msgspec
import pytest

from kvfork.server.engine.api import Scope
from kvfork.server.watch.kv_events import (FORMATS, MEDIUM_DISK, MEDIUM_MEMORY, AllBlocksCleared, BlockLedger, BlockRemoved,
                              BlockStored, KVEventBatch, chain_hashes, encode_batch, wire_hash)

zmq = pytest.importorskip("zmq")


# What consumers decode with, written from vLLM's vllm/distributed/kv_events.py as published: today's
# structs (the batch an array, each event a map tagged under "type": what vllm-router reads) ...
class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


# ... and the earlier ones (array_like: `[ts, events, dp_rank]`, each event `[class, field, ...]`; field order
# is all a decoder has).
class AKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ABlockStored(AKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class ABlockRemoved(AKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class AAllBlocksCleared(AKVCacheEvent, tag="AllBlocksCleared"):
    pass


class AKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[ABlockStored | ABlockRemoved | AAllBlocksCleared]
    data_parallel_rank: int | None = None


decode = msgspec.msgpack.Decoder(VKVEventBatch).decode
decode_array = msgspec.msgpack.Decoder(AKVEventBatch).decode
SECRET = b"s" * 32


def scope_key(scope: Scope) -> str | None:
    """An HMAC of the scope, as the disk tier names scopes; None for the default scope."""
    if scope == Scope():
        return None
    return hmac.new(SECRET, repr((scope.tenant, scope.salt)).encode(), hashlib.sha256).hexdigest()[:32]


class Ledger(BlockLedger):
    """The ledger, taking Scopes (as the engine's watches hand them over)."""

    def take(self, tokens, scope, medium):
        return super().take(tokens, scope_key(scope), medium)

    def let_go(self, tokens, scope, medium):
        return super().let_go(tokens, scope_key(scope), medium)


def ledger(block_size: int = 4) -> BlockLedger:
    return Ledger(block_size)


def test_hashes_chain_and_cover_whole_blocks_only():
    tokens = list(range(10))
    h = chain_hashes(tokens, 4)
    assert len(h) == 2  # the 2 tokens past the last whole block are never announced
    assert chain_hashes(tokens[:8], 4) == h and chain_hashes(tokens[:4], 4) == h[:1]
    other = chain_hashes([99, *tokens[1:]], 4)
    assert other[0] != h[0] and other[1] != h[1]  # a block's hash names the whole prefix before it
    assert chain_hashes(tokens, 4, ("scope",)) != h
    assert 0 <= wire_hash(h[0]) < 2**64


def test_a_shared_prefix_is_stored_once_and_removed_with_its_last_holder():
    led = ledger()
    first = led.take(list(range(8)), Scope(), MEDIUM_MEMORY)
    assert first is not None and len(first.block_hashes) == 2 and first.parent_block_hash is None
    assert first.token_ids == list(range(8)) and first.block_size == 4 and first.extra_keys is None
    longer = led.take(list(range(13)), Scope(), MEDIUM_MEMORY)  # shares both blocks, adds one (and a partial)
    assert longer.block_hashes == [wire_hash(chain_hashes(range(12), 4)[2])]
    assert longer.parent_block_hash == first.block_hashes[1] and longer.token_ids == list(range(8, 12))
    assert led.take(list(range(8)), Scope(), MEDIUM_MEMORY) is None  # nothing new
    assert led.let_go(list(range(8)), Scope(), MEDIUM_MEMORY) is None  # others still hold both blocks
    gone = led.let_go(list(range(13)), Scope(), MEDIUM_MEMORY)
    assert gone.block_hashes == longer.block_hashes  # the third block's last holder
    gone = led.let_go(list(range(8)), Scope(), MEDIUM_MEMORY)
    assert gone.block_hashes == first.block_hashes
    assert led.holders == {}


def test_media_are_counted_apart_and_a_scope_is_an_opaque_extra_key():
    led = ledger()
    tokens = list(range(8))
    mem, disk = led.take(tokens, Scope(), MEDIUM_MEMORY), led.take(tokens, Scope(), MEDIUM_DISK)
    assert disk is not None and disk.block_hashes == mem.block_hashes and disk.medium == MEDIUM_DISK
    scoped = led.take(tokens, Scope("tenant-a", "salt"), MEDIUM_MEMORY)
    assert scoped is not None and not set(scoped.block_hashes) & set(mem.block_hashes)
    key = scoped.extra_keys[0][0]
    assert scoped.extra_keys[1:] == [None] and "tenant-a" not in key and "salt" not in key
    assert led.clear(MEDIUM_DISK).block_hashes == disk.block_hashes
    assert isinstance(led.clear(), AllBlocksCleared) and led.holders == {}


@pytest.fixture
def publisher():
    from kvfork.server.watch.kv_events import KVEventPublisher

    pub = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv")
    yield pub
    pub.close()


def subscribe(endpoint: str):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(endpoint)
    return sub


def test_the_wire_decodes_with_vllms_structs(publisher):
    sub = subscribe(publisher.endpoint)
    try:
        led = ledger()
        probe = [led.clear()]
        deadline = time.monotonic() + 10
        while True:  # a PUB drops what it sends before the SUB has joined: send until one arrives
            publisher.publish(probe)
            if sub.poll(100):
                break
            assert time.monotonic() < deadline, "no batch reached the subscriber"
        while sub.poll(200):
            sub.recv_multipart()
        stored = led.take(list(range(9)), Scope("t", None), MEDIUM_MEMORY)
        removed = led.let_go(list(range(9)), Scope("t", None), MEDIUM_MEMORY)
        publisher.publish([stored, removed, AllBlocksCleared()])
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        raw = msgspec.msgpack.decode(payload)
        assert raw[2] == 0 and raw[1][0]["type"] == "BlockStored"  # [ts, events, dp_rank], each event a map
        batch = decode(payload)
        got_stored, got_removed, cleared = batch.events
        assert isinstance(got_stored, VBlockStored) and isinstance(got_removed, VBlockRemoved)
        assert isinstance(cleared, VAllBlocksCleared)
        assert got_stored.block_hashes == stored.block_hashes and got_stored.token_ids == list(range(8))
        assert got_stored.block_size == 4 and got_stored.medium == "GPU" and got_stored.parent_block_hash is None
        assert got_stored.extra_keys == [(scope_key(Scope("t", None)),), None]
        assert got_removed.block_hashes == stored.block_hashes and got_removed.medium == "GPU"
        assert abs(batch.ts - time.time()) < 60
    finally:
        sub.close(linger=0)


def test_replay_sends_what_a_subscriber_missed(publisher):
    led = ledger()
    for i in range(3):  # nobody subscribed: all three are missed
        publisher.publish([led.take([i] * 4, Scope(), MEDIUM_MEMORY)])
    time.sleep(0.3)  # the publisher thread has sent them
    # vLLM's replay protocol: [empty, start seq] in; [empty, seq, payload] per batch out, then END_SEQ
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        seqs, tokens = [], []
        while True:
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            seqs.append(int.from_bytes(seq, "big"))
            tokens.append(decode(payload).events[0].token_ids)
        assert seqs == [1, 2] and tokens == [[1] * 4, [2] * 4]
    finally:
        dealer.close(linger=0)


@pytest.mark.parametrize("wire_format", FORMATS)
def test_both_encodings_decode_with_the_consumers_structs(wire_format):
    batch = KVEventBatch(1.5, [BlockStored([1, 2], None, [0] * 8, 4, None, "GPU", None, [("k",), None]),
                               BlockStored([3], 2, [1] * 4, 4, None, "DISK", None),
                               BlockRemoved([3], "DISK"), AllBlocksCleared()], 0)
    payload = encode_batch(batch, wire_format)
    raw = msgspec.msgpack.decode(payload)
    assert raw[:1] == [1.5] and raw[2] == 0  # [ts, events, dp_rank] either way
    if wire_format == "array":
        assert raw[1][1] == ["BlockStored", [3], 2, [1] * 4, 4, None, "DISK", None]  # no trailing default
    else:
        assert raw[1][2] == {"type": "BlockRemoved", "block_hashes": [3], "medium": "DISK"}
    got = (decode_array if wire_format == "array" else decode)(payload)
    first, second, removed, cleared = got.events
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size, first.medium,
            first.extra_keys) == ([1, 2], None, [0] * 8, 4, "GPU", [("k",), None])
    assert (second.parent_block_hash, second.medium, second.extra_keys) == (2, "DISK", None)
    assert (removed.block_hashes, removed.medium) == ([3], "DISK")
    assert type(cleared).__name__.endswith("AllBlocksCleared") and got.data_parallel_rank == 0


async def test_a_daemon_publishes_what_its_prefix_cache_and_disk_tier_hold(tiny_model_dir):
    """Over HTTP on a tiny model: a captured prompt's blocks are stored in memory; evicted, they are removed
    there and stored on disk once its file is written."""
    import asyncio

    import json

    import aiohttp

    from http_daemon import chat_body, serving
    from kvfork.server.engine.cache.disk import SECRET, kv_root

    async with serving(tiny_model_dir("llama"), engine=dict(prefix_cache_entries=1),
                       kv_events_endpoint="tcp://127.0.0.1:0", kv_events_block_size=4) as d:
        sub = subscribe(d.kv_events.publisher.endpoint)
        loop = asyncio.get_running_loop()

        async def events(until, what: str) -> list:
            seen, deadline = [], loop.time() + 30
            while not until(seen):
                assert loop.time() < deadline, f"never saw {what}: {seen}"
                if sub.poll(0):
                    seen += decode(sub.recv_multipart()[2]).events
                else:
                    await asyncio.sleep(0.05)
            return seen

        try:
            async with aiohttp.ClientSession() as http:
                for i in range(100):  # the PUB drops what it sends before the subscription joins
                    async with http.post(d.url + "/v1/chat/completions",
                                         json=chat_body(f"warm up {i} " + "the long shared prompt " * 6,
                                                        max_tokens=1)) as r:
                        assert r.status == 200
                    if sub.poll(200):
                        break
                while sub.poll(300):
                    sub.recv_multipart()
                async with http.post(d.url + "/v1/chat/completions",
                                     json=chat_body("first " + "the long shared prompt " * 6, max_tokens=1)) as r:
                    assert r.status == 200
                got = await events(lambda s: any(isinstance(e, VBlockStored) and e.medium == "GPU" for e in s),
                                   "the first prompt stored")
                stored = next(e for e in got if isinstance(e, VBlockStored) and e.medium == "GPU")
                assert stored.block_size == 4 and len(stored.token_ids) == 4 * len(stored.block_hashes) > 0
                assert stored.extra_keys is None  # the default scope: no extra key
                async with http.post(d.url + "/v1/chat/completions",
                                     json=chat_body("second " + "another prompt entirely " * 6, max_tokens=1)) as r:
                    assert r.status == 200  # its capture evicts the first (one entry kept), which spills to disk

                def hashes(seen: list, kind: type, medium: str) -> set[int]:
                    return {h for e in seen if isinstance(e, kind) and e.medium == medium for h in e.block_hashes}

                first = set(stored.block_hashes)
                got = await events(lambda s: first <= hashes(s, VBlockStored, "DISK"), "the first prompt on disk")
                assert first <= hashes(got, VBlockRemoved, "GPU")  # the same blocks, by the same hashes
                async with http.post(d.url + "/v1/chat/completions",
                                     json=chat_body("salted " + "the long shared prompt " * 6, max_tokens=1,
                                                    cache_salt="s")) as r:
                    assert r.status == 200
                got = await events(lambda s: any(isinstance(e, VBlockStored) and e.extra_keys for e in s),
                                   "the salted prompt stored")
                salted = next(e for e in got if isinstance(e, VBlockStored) and e.extra_keys)
                # the scope's name is the one its disk files carry: an HMAC under $KVFORK_HOME/kv-secret, never a
                # plain hash of the tenant and salt that could be guessed offline (issue 22)
                secret = (kv_root().parent / SECRET).read_bytes()
                assert salted.extra_keys[0] == (Scope("", "s").digest(secret),)
                assert salted.extra_keys[0][0] != hashlib.sha256(json.dumps(["", "s"]).encode()).hexdigest()[:32]
        finally:
            sub.close(linger=0)


# ---- issue 33, findings 1-3: who may read ----


def test_a_keyed_daemon_publishes_only_where_the_operator_said_who_reads(tmp_path):
    from kvfork.server.watch.kv_events import readers, refusal

    tcp = "tcp://127.0.0.1:5557"
    assert refusal(tcp, keyed=False, public=False, hashes_only=False) is None  # one tenant: nobody else's prompts
    reason = refusal(tcp, keyed=True, public=False, hashes_only=False)
    assert reason is not None and "--kv-events-public" in reason and "ipc://" in reason
    assert refusal(tcp, keyed=True, public=True, hashes_only=False) is None
    assert refusal(tcp, keyed=True, public=False, hashes_only=True) is None
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    assert refusal(f"ipc://{private}/kv", keyed=True, public=False, hashes_only=False) is None
    assert refusal(f"ipc://{shared}/kv", keyed=True, public=False, hashes_only=False) is not None
    link = tmp_path / "link"
    link.symlink_to(private, target_is_directory=True)
    assert refusal(f"ipc://{link}/kv", keyed=True, public=False, hashes_only=False) is not None
    assert "this user only" in readers(f"ipc://{private}/kv", False)
    assert "any process on this machine" in readers(tcp, False) and "token ids" in readers(tcp, False)
    assert "over the network" in readers("tcp://0.0.0.0:5557", True) and "no token ids" in readers(tcp, True)


async def test_a_keyed_daemon_refuses_an_open_endpoint_at_start(tiny_model_dir, tmp_path):
    from http_daemon import serving

    keys = tmp_path / "keys"
    keys.write_text("key-a tenant-a\n")
    with pytest.raises(OSError, match="--kv-events-public"):
        async with serving(tiny_model_dir("llama"), load=False, api_keys_file=str(keys),
                           kv_events_endpoint="tcp://127.0.0.1:0"):
            pass


def test_hashes_only_publishes_no_token_ids_nor_scope_keys():
    from kvfork.server.watch.kv_events import KVEvents

    class Collect:
        def __init__(self):
            self.batches: list = []

        def publish(self, events):
            self.batches.append(events)

        def starting(self):
            pass

    collect = Collect()
    events = KVEvents(collect, 4, hashes_only=True)  # type: ignore[arg-type]
    events.default = "default"
    events.publish(events.ledger.take(list(range(9)), "scope-digest", MEDIUM_MEMORY))
    (stored,) = collect.batches[-1]
    assert stored.token_ids == [] and stored.extra_keys is None and len(stored.block_hashes) == 2


def test_inbound_messages_and_queues_are_capped(publisher):
    from kvfork.server.watch.kv_events import MAX_INBOUND, QUEUE_BATCHES

    for sock in (publisher._pub, publisher._replay):  # noqa: SLF001  the sockets' options, read back
        assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_INBOUND
        assert sock.getsockopt(zmq.SNDHWM) == QUEUE_BATCHES
    # a keyless peer's huge frame is refused by ZMQ (the peer is dropped), and replay still answers others
    big = zmq.Context.instance().socket(zmq.DEALER)
    big.connect(publisher.replay_endpoint)
    big.send_multipart((b"", b"x" * (8 * 1024 * 1024)))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        assert dealer.recv_multipart()[1] == (-1).to_bytes(8, "big", signed=True)
    finally:
        big.close(linger=0)
        dealer.close(linger=0)


def test_start_up_announcements_are_never_replayed(publisher):
    led = ledger()
    publisher.starting()
    publisher.publish([led.take([7] * 4, Scope(), MEDIUM_DISK)])  # a file found at start
    publisher.started()
    publisher.publish([led.take([8] * 4, Scope(), MEDIUM_MEMORY)])
    time.sleep(0.3)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        tokens = []
        while (frames := dealer.recv_multipart())[1] != (-1).to_bytes(8, "big", signed=True):
            tokens.append(decode(frames[2]).events[0].token_ids)
        assert tokens == [[8] * 4]
    finally:
        dealer.close(linger=0)
