"""Named sessions: a client's conversation kept warm between its requests.

The control loop owns this table; the state a session keeps between requests is an
entry of the index (index.py, tier "named"), held as a runner session id. Design rules:
- warm resume: a prompt that extends the exact tokens the session holds (its
  last prompt and what it generated, as committed) prefills only the new tokens;
  anything else restarts the session cold;
- one request at a time per session: a second, while the first runs, runs without it
  (`acquire` gives None), from the prefix cache or active reuse like any anonymous request:
  neither OpenAI's nor Anthropic's API refuses concurrent requests;
- at most `max_sessions` per tenant; a tenant's new session evicts that tenant's
  least recently used idle one, never another tenant's (when every one of the tenant's is
  busy, a new name runs without a session);
- idle sessions give way to admission after the prefix cache, least recently
  used first: the record stays, its state goes, and its owner's next request
  starts cold (never an error);
- an idle session counts the bytes the runner measured as its own (it may read
  blocks of others by reference: those are theirs, or pooled); dropping its state
  frees at once what nobody else reads (`frees`), the rest once the runner has
  released it (Admission.release_sessions);
- a session id names a session of one tenant: the same id under another tenant
  is another session; a session resumes only a request of the scope (tenant and
  cache_salt) that computed its state, and restarts cold for any other.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from kvfork.server.engine.api import Scope, SessionBusy
from kvfork.server.engine.cache.index import Index
from kvfork.server.engine.policy.entries import Entry

MAX_SESSION_ID = 128

Taken = tuple[list[int], int]  # (runner session ids to release, bytes of them others still read)


def check_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID or not all(" " <= c <= "~" for c in session_id):
        raise ValueError(f"session_id must be 1-{MAX_SESSION_ID} printable ASCII characters")


@dataclass
class NamedSession:
    name: str
    tenant: str = ""
    busy: bool = False
    state: Entry | None = None  # what it keeps, an entry of the index (tier "named"); None: nothing
    frees: int = 0  # what releasing its state frees at once (Backend.release_frees, when it was kept)

    @property
    def key(self) -> tuple[str, str]:
        return self.tenant, self.name

    def resumes(self, prompt: Sequence[int], scope: str) -> bool:
        """Whether a prompt of `scope` (a digest: Index.digest) extends what it holds."""
        state = self.state
        if state is None or state.scope != scope:
            return False
        held = len(state.tokens)
        return 0 < held < len(prompt) and tuple(prompt[:held]) == state.tokens


class NamedSessions:
    def __init__(self, max_sessions: int, index: Index):
        self.max_sessions = max_sessions
        self._index = index
        self._table: OrderedDict[tuple[str, str], NamedSession] = OrderedDict()  # by (tenant, name), LRU first

    def __len__(self) -> int:
        return len(self._table)

    def idle_bytes(self) -> int:
        """Bytes held by sessions no request is using (busy ones are counted by their request)."""
        return sum(r.state.nbytes for r in self._idle_holding() if r.state is not None)

    def evict_bytes(self, need: int) -> Taken:
        """Drop the state of idle sessions, least recently used first, until `need` bytes are freed
        (or none is left). The records stay: their next request starts cold."""
        out, freed, still_read = [], 0, 0
        for record in self._idle_holding():
            if freed >= need:
                break
            freed += record.frees
            sids, read = self.take(record)
            out += sids
            still_read += read
        return out, still_read

    def _idle_holding(self) -> list[NamedSession]:
        return [r for r in self._table.values() if not r.busy and r.state is not None]

    def holding(self) -> int:
        """How many sessions hold KV state."""
        return sum(1 for r in self._table.values() if r.state is not None)

    def get(self, name: str, tenant: str = "") -> NamedSession | None:
        return self._table.get((tenant, name))

    def acquire(self, name: str, tenant: str = "") -> tuple[NamedSession | None, Taken]:
        """Mark `tenant`'s session `name` busy (creating it); returns it and the state evicted to make room.
        None when it is busy: the request runs without it."""
        key = tenant, name
        record = self._table.get(key)
        evicted: Taken = ([], 0)
        if record is not None and record.busy:
            return None, evicted
        if record is None:
            own = [r for r in self._table.values() if r.tenant == tenant]
            if len(own) >= self.max_sessions:
                idle = next((r for r in own if not r.busy), None)
                if idle is None:  # every session of this tenant is busy: this request runs without one
                    return None, evicted
                del self._table[idle.key]
                evicted = self.take(idle)
            record = self._table[key] = NamedSession(name, tenant)
        self._table.move_to_end(key)
        record.busy = True
        return record, evicted

    def take(self, record: NamedSession) -> Taken:
        """Its state leaves the record: ([its session id] or [], bytes of it others still read)."""
        state, record.state = record.state, None
        if state is None:
            return [], 0
        self._index.drop(state)
        assert state.sid is not None
        return [state.sid], max(0, state.nbytes - record.frees)

    def release(self, record: NamedSession, sid: int | None, tokens: Sequence[int], scope: Scope, nbytes: int = 0,
                frees: int = 0) -> None:
        """The request on `record` ended, leaving session `sid` holding `tokens`, computed under `scope`, with
        `nbytes` of its own of which releasing it frees `frees` at once."""
        record.busy, record.frees = False, frees if sid is not None else 0
        if sid is not None:
            record.state = Entry("named", self._index.digest(scope), tuple(tokens), record.key, sid, nbytes)
            self._index.hold_named(record.state)

    def give_back(self, record: NamedSession) -> None:
        """The request on `record` left before it ran: the record keeps what it held."""
        record.busy = False

    def drop(self, name: str, forget: bool, tenant: str = "") -> tuple[bool, Taken]:
        """Reset (forget=False) or delete `tenant`'s session; returns (existed, its state: `take`)."""
        record = self._table.get((tenant, name))
        if record is None:
            return False, ([], 0)
        if record.busy:
            raise SessionBusy(f"session {name!r} is busy with another request")
        held = self.take(record)
        if forget:
            del self._table[record.key]
        return True, held

    def clear(self) -> list[int]:
        held = [sid for r in self._table.values() for sid in self.take(r)[0]]
        self._table.clear()
        return held
