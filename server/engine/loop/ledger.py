"""The loop's ledger of the runner's bytes: what the budget counts that no request, capture, cache entry or
named session holds on the loop, because the runner holds it or has not yet run what the loop asked.

The runner runs commands later than the loop sends them, and reports what the backend holds only as of
the events it publishes (`messages.Ledger`). Between the two, bytes the loop has let go of may still
exist on the runner; each term below counts such bytes until the runner's answer shows they are gone:

- pooled: blocks whose writer was released that other sessions still read, as the runner's last Ledger
  reported them (`Backend.pooled_bytes`). No session's holder counts them any more, yet they exist.
- in transit: what a released session wrote that others still read, from the loop's ReleaseSessions until the
  runner reports that ReleaseSessions run (`Ledger.releases`); from then on the pool counts it. Without this
  term those blocks would be counted by no one while the ReleaseSessions waits in the runner's queue.
- abandoned: each clone or state load ordered from the runner that its request stopped waiting for (it
  left, or its follow timed out), until the runner answers the order (CloneDone, StateLoaded): the runner
  may have made the session already, or may still. Several orders of one request are answered oldest first.
- freeing: not a term of `nbytes` but a credit against it: what the pool is expected to lose once the runner
  runs a ReleaseSessions of prefix cache entries (the blocks they read, `Entry.reads`), until the runner
  reports that ReleaseSessions run. Eviction counts it as freed already, so it waits for the runner's
  report instead of evicting more entries for bytes that are on their way out.
- spilling: prefix cache entries evicted to the disk tier, from their eviction until their file is written
  (or fails): the runner exports them to host arrays, which live until the disk thread is done.

Admission counts `nbytes` in what it holds, so none of these bytes is given out twice.
"""

from __future__ import annotations

import collections

from kvfork.server.engine import messages as m


class LoopLedger:
    def __init__(self) -> None:
        self._runner = m.Ledger()  # the runner's last report
        self._releases_sent = 0
        self._in_transit: collections.deque[tuple[int, int]] = collections.deque()  # (ReleaseSessions number, bytes)
        self._freeing: collections.deque[tuple[int, int]] = collections.deque()  # (ReleaseSessions number, bytes)
        self._abandoned: dict[int, collections.deque[int]] = {}  # rid -> bytes of each order, oldest first
        self._spilling = 0

    # ---- reads ----

    @property
    def runner(self) -> m.Ledger:
        """The runner's last report: sessions open, their bytes, the pool, its blocks."""
        return self._runner

    @property
    def nbytes(self) -> int:
        """Everything this ledger counts: pooled, in transit, abandoned orders and spilling entries."""
        return self.pooled + self.in_transit + sum(sum(orders) for orders in self._abandoned.values()) + self._spilling

    @property
    def pooled(self) -> int:
        return self._runner.pooled_bytes

    @property
    def in_transit(self) -> int:
        return sum(nbytes for _, nbytes in self._in_transit)

    @property
    def freeing(self) -> int:
        """Pooled bytes the ReleaseSessions sent and not yet run are expected to free."""
        return sum(nbytes for _, nbytes in self._freeing)

    def reclaimable(self, reads: int) -> int:
        """Of `reads` bytes of blocks read by reference, what releasing their readers may free: at most the pool
        and what is on its way to it, less what releases sent already free (a writer still running frees none)."""
        return max(0, min(reads, self.pooled + self.in_transit - self.freeing))

    @property
    def abandoned(self) -> int:
        """How many orders no one waits for the runner has not answered yet."""
        return sum(len(orders) for orders in self._abandoned.values())

    @property
    def spilling(self) -> int:
        return self._spilling

    # ---- the loop's entries ----

    def released(self, still_read: int, freeing: int = 0) -> None:
        """One ReleaseSessions command was sent; `still_read`: what of its sessions' own bytes others still read;
        `freeing`: what of the pool it is expected to free."""
        self._releases_sent += 1
        if still_read:
            self._in_transit.append((self._releases_sent, still_read))
        if freeing:
            self._freeing.append((self._releases_sent, freeing))

    def abandon(self, rid: int, nbytes: int) -> None:
        """Request `rid` stopped waiting for an order of `nbytes` it sent the runner."""
        self._abandoned.setdefault(rid, collections.deque()).append(nbytes)

    def answered(self, rid: int) -> bool:
        """The runner answered `rid`'s oldest order: True if it was abandoned (its bytes go back here; the
        caller releases the session it brought, if any)."""
        orders = self._abandoned.get(rid)
        if not orders:
            return False
        orders.popleft()
        if not orders:
            del self._abandoned[rid]
        return True

    def spill(self, nbytes: int) -> None:
        """An evicted entry of `nbytes` is on its way to the disk tier."""
        self._spilling += nbytes

    def spilled(self, nbytes: int) -> None:
        """A spill is over (its file written, or not): its bytes go back."""
        self._spilling -= nbytes

    # ---- the runner's reports ----

    def update(self, ledger: m.Ledger) -> None:
        """The runner's report, read in the order it was sent: the Releases it had run are in its pool."""
        self._runner = ledger
        for pending in (self._in_transit, self._freeing):
            while pending and pending[0][0] <= ledger.releases:
                pending.popleft()
