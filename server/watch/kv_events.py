"""KV events in vLLM's format, for routers that route on the KV state replicas really hold.

vllm-router's kv_aware policy, llm-d's precise prefix-cache scorer and Dynamo's KV
router all read vLLM's KV events: a ZMQ PUB socket sending three frames per batch
(topic, an 8-byte big-endian sequence number, a msgpack payload), and a ROUTER
socket that replays missed batches from a sequence number on. The payload is an
array `[ts, events, data_parallel_rank]` of tagged events, each a map (vLLM's
encoding today, which vllm-router reads):

    {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
     "medium", "lora_name", "extra_keys"}
    {"type": "BlockRemoved", "block_hashes", "medium"}
    {"type": "AllBlocksCleared"}

or, with `--kv-events-format array`, each event an array (vLLM's earlier encoding,
which older consumers decode): `["BlockStored", block_hashes, parent_block_hash,
...]`, the same fields in the same order.

Design rules:
- blocks are whole `block_size`-token runs of a state kvfork keeps for reuse (a
  prefix cache entry, a disk tier file); the tail shorter than a block is never
  announced, as vLLM never announces a partial block;
- a block's hash chains vLLM's way: sha256 over (parent hash, the block's token
  ids, its extra keys), msgpack-encoded where vLLM pickles or CBOR-encodes, the
  first block's parent a fixed root, so a hash names the whole prefix up to its
  block; the event carries the last 8 bytes as an unsigned integer (vLLM's integer
  form); consumers recompute their own from the token ids;
- a block is stored when the first holder in a medium takes it and removed when
  the last lets go (`BlockLedger`, pure): prefixes shared by several entries are
  announced once;
- the scope (tenant, cache_salt) enters the first block's extra keys as an opaque
  digest (the index's name for it, an HMAC: never a tenant's name or key) and so every
  hash after it; the default scope (no keys, no salt) has none, so a router that
  hashes token ids alone matches it;
- the publisher never blocks the caller: batches queue to a thread that owns both
  sockets; a full queue drops the batch and counts it (a consumer sees the gap in
  the sequence numbers and asks for a replay, or resyncs);
- who reads the stream reads every tenant's prompt token ids: a daemon with API keys
  publishes only where the operator said who may read (`refusal`: an ipc:// endpoint
  in a private folder, --kv-events-public, or hashes only), and the start-up line
  names them (`readers`); --kv-events-hashes-only publishes neither token ids nor
  scope keys (a router that takes block hashes as they come needs neither);
- a keyless peer costs little: inbound messages (subscriptions, replay requests) are
  capped at MAX_INBOUND bytes, queues at QUEUE_BATCHES, and what was announced at
  start (the disk tier's files found there) goes to the subscribers of that moment
  only, never to a replay.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import stat
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgspec

from kvfork.server.engine.api import Scope

log = logging.getLogger("kvfork.kv_events")

MEDIUM_MEMORY = "GPU"  # vLLM's name for the engine's own KV memory, whatever the device (CPU here too)
MEDIUM_DISK = "DISK"
ROOT_HASH = hashlib.sha256(b"kvfork kv events root").digest()  # the first block's parent
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # closes a replay
MAX_INBOUND = 1024  # bytes of one inbound message: a subscription's topic, a replay request
QUEUE_BATCHES = 1_000  # batches queued for the publisher thread, and per subscriber in ZMQ (its high-water mark)
_STARTING, _STARTED = object(), object()  # on the queue: what follows is never replayed / is again


# ---- the wire: vLLM's structs (vllm/distributed/kv_events.py), field order as published ----

class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events; `tag=True` names each event's class in it (`type` in a map, first in an array)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # one entry per block


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


FORMATS = ("map", "array")
_pack_wire = msgspec.msgpack.Encoder()


def _as_array(struct: msgspec.Struct) -> list:
    """A struct as vLLM's `array_like` structs encode it: fields in order, trailing defaults left out."""
    fields = [getattr(struct, name) for name in struct.__struct_fields__]
    defaults = struct.__struct_defaults__
    keep = len(fields)
    while keep > len(fields) - len(defaults) and fields[keep - 1] == defaults[keep - 1 - (len(fields) - len(defaults))]:
        keep -= 1
    return fields[:keep]


def encode_batch(batch: KVEventBatch, wire_format: str = "map") -> bytes:
    """The batch is always an array, `[ts, events, dp_rank]`. Its events: `map`, vLLM's current encoding
    (each a map, its class under `type`), which vllm-router reads; `array`, the earlier one
    (`[class, field, ...]`), which older consumers read."""
    if wire_format == "map":
        events = batch.events
    else:
        events = [[type(e).__name__, *_as_array(e)] for e in batch.events]
    return _pack_wire.encode(_as_array(msgspec.structs.replace(batch, events=events)))


# ---- block hashes ----

_pack = msgspec.msgpack.Encoder()


def chain_hashes(tokens: Sequence[int], block_size: int, first_extra: tuple | None = None) -> list[bytes]:
    """The chained hash of every whole block of `tokens`; `first_extra`: the first block's extra keys."""
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        block = list(tokens[i * block_size:(i + 1) * block_size])
        extra = first_extra if i == 0 else None
        parent = hashlib.sha256(_pack.encode([parent, block, extra])).digest()
        out.append(parent)
    return out


def wire_hash(digest: bytes) -> int:
    """vLLM's integer form of a block hash: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


# ---- who may read ----


def _ipc_folder(endpoint: str) -> str | None:
    return os.path.dirname(os.path.abspath(endpoint.removeprefix("ipc://"))) if endpoint.startswith("ipc://") else None


def private_folder(folder: str) -> bool:
    """Whether `folder` is a folder (not a link) of this user that no one else may enter (0700 or narrower)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def loopback(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def readers(endpoint: str, hashes_only: bool) -> str:
    """Who can read the stream on `endpoint`, for the start-up line."""
    what = "block hashes (no token ids)" if hashes_only else "every tenant's prompt token ids"
    folder = _ipc_folder(endpoint)
    if folder is not None:
        who = f"this user only ({folder} is private)" if private_folder(folder) else \
            f"whoever may enter {folder} (it is not private: make it 0700)"
    elif loopback(endpoint):
        who = "any process on this machine"
    else:
        who = "anyone who can reach it over the network"
    return f"{what}, readable by {who}"


def refusal(endpoint: str, keyed: bool, public: bool, hashes_only: bool) -> str | None:
    """Why a daemon may not publish on `endpoint`, or None. A keyless daemon has one tenant: its stream tells
    nothing another tenant sent. A keyed one needs the operator to have said who may read."""
    folder = _ipc_folder(endpoint)
    if not keyed or public or hashes_only or (folder is not None and private_folder(folder)):
        return None
    return (f"--kv-events-endpoint {endpoint}: KV events carry every tenant's prompt token ids, and this daemon has "
            "API keys: publish on ipc:// in a private (0700) folder of this user, add --kv-events-public to "
            "let whoever reaches the endpoint read them, or --kv-events-hashes-only")


# ---- which blocks each medium holds (pure) ----

@dataclass
class BlockLedger:
    """Holders per (medium, block): what to announce when a holder takes or lets go of a token run.

    `scope`: the run's scope as an opaque key (None: the default scope), the first block's extra key."""

    block_size: int
    holders: dict[tuple[str, bytes], int] = field(default_factory=dict)

    def _blocks(self, tokens: Sequence[int], scope: str | None) -> tuple[list[bytes], tuple | None]:
        first_extra = (scope,) if scope is not None else None
        return chain_hashes(tokens, self.block_size, first_extra), first_extra

    def take(self, tokens: Sequence[int], scope: str | None, medium: str) -> BlockStored | None:
        """A holder in `medium` now holds `tokens`: the blocks nobody there held before, if any (they are
        always a run at the end of the chain: a holder holds a prefix whole)."""
        hashes, first_extra = self._blocks(tokens, scope)
        new_from = None
        for i, h in enumerate(hashes):
            count = self.holders.get((medium, h), 0)
            self.holders[medium, h] = count + 1
            if count == 0 and new_from is None:
                new_from = i
        if new_from is None:
            return None
        n = self.block_size
        return BlockStored(
            block_hashes=[wire_hash(h) for h in hashes[new_from:]],
            parent_block_hash=wire_hash(hashes[new_from - 1]) if new_from else None,
            token_ids=list(tokens[new_from * n:len(hashes) * n]),
            block_size=n, lora_id=None, medium=medium, lora_name=None,
            extra_keys=[first_extra if i == 0 else None for i in range(new_from, len(hashes))]
            if first_extra is not None else None)

    def let_go(self, tokens: Sequence[int], scope: str | None, medium: str) -> BlockRemoved | None:
        """A holder in `medium` let go of `tokens`: the blocks nobody there holds any more, if any."""
        hashes, _ = self._blocks(tokens, scope)
        gone = []
        for h in hashes:
            count = self.holders.get((medium, h), 0)
            if count <= 1:
                self.holders.pop((medium, h), None)
                if count == 1:
                    gone.append(wire_hash(h))
            else:
                self.holders[medium, h] = count - 1
        return BlockRemoved(block_hashes=gone, medium=medium) if gone else None

    def clear(self, medium: str | None = None) -> AllBlocksCleared | BlockRemoved | None:
        """Every holder gone (None: every medium, as at start): AllBlocksCleared; one medium: its blocks removed."""
        if medium is None:
            self.holders.clear()
            return AllBlocksCleared()
        gone = [wire_hash(h) for (m, h) in self.holders if m == medium]
        self.holders = {k: v for k, v in self.holders.items() if k[0] != medium}
        return BlockRemoved(block_hashes=gone, medium=medium) if gone else None


class Watch:
    """What the index (server/engine/cache/index.py) tells of one tier's entries as they come and go:
    `stored(tokens, scope)` once an entry holds `tokens`, `removed(tokens, scope)` once it lets go
    (`scope`: the entry's scope digest, never a tenant's name or key)."""

    def __init__(self, events: "KVEvents", medium: str):
        self.events, self.medium = events, medium

    def stored(self, tokens: Sequence[int], scope: str) -> None:
        self.events.publish(self.events.ledger.take(tokens, self.events.key(scope), self.medium))

    def removed(self, tokens: Sequence[int], scope: str) -> None:
        self.events.publish(self.events.ledger.let_go(tokens, self.events.key(scope), self.medium))


class KVEvents:
    """The engine's side: a ledger of blocks and the publisher its announcements go to. Control loop only.

    A scope is keyed by the index's name for it (Index.digest: an HMAC, never a tenant's name or key);
    the default scope's becomes no extra key at all."""

    def __init__(self, publisher: "KVEventPublisher", block_size: int, hashes_only: bool = False):
        self.publisher, self.ledger, self.hashes_only = publisher, BlockLedger(block_size), hashes_only
        self.default: str | None = None  # the default scope's digest (`attach`)
        self.publisher.starting()
        self.publish(self.ledger.clear())  # a (re)started replica holds nothing yet

    def key(self, digest: str) -> str | None:
        return None if digest == self.default else digest

    def publish(self, event: KVCacheEvent | None) -> None:
        if isinstance(event, BlockStored) and self.hashes_only:
            event = msgspec.structs.replace(event, token_ids=[], extra_keys=None)
        if event is not None:
            self.publisher.publish([event])

    def attach(self, index: Any, disk: bool) -> None:
        """Watch the index's prefix cache and, with `disk` (the disk tier is on), its files; the files found
        at start are announced at once."""
        self.default = index.digest(Scope())
        index.watch("memory", Watch(self, MEDIUM_MEMORY))
        if disk:
            index.watch("disk", Watch(self, MEDIUM_DISK))
        self.publisher.started()  # the files found at start went to the subscribers of that moment only

    def close(self) -> None:
        self.publisher.close()


# ---- the ZMQ publisher ----

class KVEventPublisher:
    """PUB on `endpoint` (bound), replays on `replay_endpoint` (bound, ROUTER); one thread owns both.

    `publish(events)` queues one batch; it never blocks and never raises for a slow consumer."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", dp_rank: int = 0,
                 wire_format: str = "map", buffer_batches: int = 10_000, queue_size: int = QUEUE_BATCHES,
                 hwm: int = QUEUE_BATCHES):
        import zmq  # pyzmq: only when KV events are asked for

        assert wire_format in FORMATS, wire_format
        self._zmq, self.wire_format = zmq, wire_format
        self.topic, self.dp_rank = topic.encode(), dp_rank
        self.dropped = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._replayable = True  # False between `starting` and `started`
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = 0
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay = ctx.socket(zmq.ROUTER) if replay_endpoint else None
        for socket, address in ((self._pub, endpoint), (self._replay, replay_endpoint)):
            if socket is None:
                continue
            socket.set_hwm(hwm)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND)  # a bigger message from a peer: disconnected
            try:
                socket.bind(address)
            except zmq.ZMQError as e:
                self._pub.close(linger=0)
                if self._replay is not None:
                    self._replay.close(linger=0)
                raise OSError(f"cannot bind {address}: {e}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://127.0.0.1:0 resolves here
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank))
        except queue.Full:
            self.dropped += 1

    def starting(self) -> None:
        """What is published from now to `started` (start-up announcements) goes to the subscribers of the moment
        and is never replayed."""
        self._queue.put(_STARTING)

    def started(self) -> None:
        self._queue.put(_STARTED)

    def close(self, timeout_s: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        poller = None
        if self._replay is not None:
            poller = self._zmq.Poller()
            poller.register(self._replay, self._zmq.POLLIN)
        try:
            while True:
                if poller is not None and poller.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                if batch is _STARTING or batch is _STARTED:
                    self._replayable = batch is _STARTED
                    continue
                payload = encode_batch(batch, self.wire_format)
                self._pub.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
                if self._replayable:
                    self._sent.append((self._seq, payload))
                self._seq += 1
        except Exception:  # the publisher is optional: it stops, serving goes on
            log.exception("KV event publisher stopped")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        """A request (identity, empty, 8-byte start) gets every buffered batch from there on, then END_SEQ."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
