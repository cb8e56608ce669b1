"""What the engine holds at one moment, as one frozen value: `Engine.stats()` (made by `Serving.stats`).

Tests, tools and the daemon read the engine through it rather than through its managers' parts; each
field says where it comes from. Before the model has loaded every figure is 0 and `loaded` is False.

    stats = engine.stats()
    stats.reserved, stats.held, stats.budget  # bytes (Admission): reserved by requests, held in all, the budget
    stats.pooled, stats.in_transit, stats.spilling, stats.abandoned  # what the loop's ledger counts (ledger.py)
    stats.live_sessions, stats.total_bytes, stats.blocks  # the backend, as the runner last reported (messages.Ledger)
    stats.slots_used, stats.queued, stats.paused, stats.following, stats.captures_in_use
    stats.cached, stats.cached_bytes  # the prefix cache's memory tier (Index)
    stats.on_disk, stats.disk_bytes, stats.disk_on  # the disk tier's files (Index), their bytes, whether it writes
    stats.disk_spilled, stats.disk_corrupt  # files it wrote, and bad files it removed, since start
    stats.named_sessions, stats.named_holding  # named sessions kept, and those holding state
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfork.backends.base import BlockStats


@dataclass(frozen=True)
class EngineStats:
    loaded: bool = False
    # the budget (Admission)
    budget: int = 0  # bytes of KV state the engine may hold
    held: int = 0  # bytes it counts now: reserved, the prefix cache, idle named sessions, and the ledger's below
    reserved: int = 0  # of those, what requests and captures reserve
    # the loop's ledger of the runner's bytes (ledger.LoopLedger)
    pooled: int = 0  # blocks no one session holds that others still read, as the runner last reported
    in_transit: int = 0  # what released sessions wrote that others read, until the runner ran the ReleaseSessions
    spilling: int = 0  # evicted cache entries on their way to disk
    abandoned: int = 0  # clone or load orders no one waits for that the runner has not answered yet (a count)
    # the backend, as the runner last reported (messages.Ledger)
    live_sessions: int = 0  # sessions open
    total_bytes: int = 0  # bytes of KV state they hold (compare `held`)
    blocks: BlockStats | None = None  # a backend with blocks: blocks held, shared, bytes saved by sharing
    # requests
    slots_used: int = 0
    queued: int = 0
    paused: int = 0  # gave their slot to a tenant below its share (fair_share.preempt); they wait to decode on
    following: int = 0  # parked behind a leader
    captures_in_use: int = 0
    # reusable states (Index, NamedSessions, DiskTier)
    cached: int = 0  # prefix cache entries in memory
    cached_bytes: int = 0
    on_disk: int = 0  # the disk tier's files
    disk_bytes: int = 0  # their bytes (what the tier says it holds)
    disk_spilled: int = 0  # entries written to the disk tier since start
    disk_corrupt: int = 0  # its files found torn, corrupt or malformed, and removed, since start
    disk_on: bool = False  # the disk tier is open and writing
    named_sessions: int = 0
    named_holding: int = 0  # named sessions holding KV state
