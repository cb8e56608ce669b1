"""Named sessions: a client's conversation kept warm between its requests.

The control loop owns this table; the backend sessions in it are opaque handles
the runner touches. Design rules:
- warm resume: a prompt that extends the exact tokens the session holds (its
  last prompt and what it generated, as committed) prefills only the new tokens;
  anything else restarts the session cold;
- one request at a time per session: a second, while the first runs, runs without it
  (`acquire` gives None), from the prefix cache or active reuse like any anonymous request:
  neither OpenAI's nor Anthropic's API refuses concurrent requests;
- at most `max_sessions`; the least recently used idle one goes first (when every one is
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
from dataclasses import dataclass, field
from typing import Any, Sequence

from server.engine.api import Scope, SessionBusy

MAX_SESSION_ID = 128


def check_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID or not all(" " <= c <= "~" for c in session_id):
        raise ValueError(f"session_id must be 1-{MAX_SESSION_ID} printable ASCII characters")


@dataclass
class NamedSession:
    name: str
    tenant: str = ""
    session: Any = None  # backend session, None when it holds nothing
    tokens: list[int] = field(default_factory=list)  # what `session` has committed
    busy: bool = False
    scope: Scope = Scope()  # the scope that computed `session`
    nbytes: int = 0  # `session`'s own bytes (Backend.session_bytes)
    frees: int = 0  # what releasing `session` frees at once (Backend.release_frees, when it was kept)

    @property
    def key(self) -> tuple[str, str]:
        return self.tenant, self.name

    def resumes(self, prompt: Sequence[int], scope: Scope) -> bool:
        held = len(self.tokens)
        return (self.session is not None and scope == self.scope and 0 < held < len(prompt)
                and list(prompt[:held]) == self.tokens)

    def take(self) -> tuple[list[Any], int]:
        """Its state leaves the record: ([the session] or [], bytes of it others still read)."""
        taken = ([self.session] if self.session is not None else [], max(0, self.nbytes - self.frees))
        self.session, self.tokens, self.nbytes, self.frees = None, [], 0, 0
        return taken


class NamedSessions:
    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self._table: OrderedDict[tuple[str, str], NamedSession] = OrderedDict()  # by (tenant, name), LRU first

    def __len__(self) -> int:
        return len(self._table)

    def idle_bytes(self) -> int:
        """Bytes held by sessions no request is using (busy ones are counted by their request)."""
        return sum(r.nbytes for r in self._idle_holding())

    def evict_bytes(self, need: int) -> tuple[list[Any], int]:
        """Drop the state of idle sessions, least recently used first, until `need` bytes are freed
        (or none is left); returns the sessions to release and what of them others still read. The
        records stay: their next request starts cold."""
        out, freed, still_read = [], 0, 0
        for record in self._idle_holding():
            if freed >= need:
                break
            freed += record.frees
            sessions, read = record.take()
            out += sessions
            still_read += read
        return out, still_read

    def _idle_holding(self) -> list[NamedSession]:
        return [r for r in self._table.values() if not r.busy and r.session is not None]

    def holding(self) -> int:
        """How many sessions hold KV state."""
        return sum(1 for r in self._table.values() if r.session is not None)

    def get(self, name: str, tenant: str = "") -> NamedSession | None:
        return self._table.get((tenant, name))

    def acquire(self, name: str, tenant: str = "") -> tuple[NamedSession | None, tuple[list[Any], int]]:
        """Mark `tenant`'s session `name` busy (creating it); returns it and the state evicted to make room
        (NamedSession.take). None when it is busy: the request runs without it."""
        key = tenant, name
        record = self._table.get(key)
        evicted: tuple[list[Any], int] = ([], 0)
        if record is not None and record.busy:
            return None, evicted
        if record is None:
            if len(self._table) >= self.max_sessions:
                idle = next((r for r in self._table.values() if not r.busy), None)
                if idle is None:  # every session is busy: this request runs without one
                    return None, evicted
                del self._table[idle.key]
                evicted = idle.take()
            record = self._table[key] = NamedSession(name, tenant)
        self._table.move_to_end(key)
        record.busy = True
        return record, evicted

    def release(self, record: NamedSession, session: Any, tokens: list[int], scope: Scope, nbytes: int = 0,
                frees: int = 0) -> None:
        """The request on `record` ended, leaving `session` holding `tokens`, computed under `scope`, with
        `nbytes` of its own of which releasing it frees `frees` at once."""
        record.session, record.tokens, record.busy, record.scope = session, tokens, False, scope
        record.nbytes, record.frees = (nbytes, frees) if session is not None else (0, 0)

    def drop(self, name: str, forget: bool, tenant: str = "") -> tuple[bool, tuple[list[Any], int]]:
        """Reset (forget=False) or delete `tenant`'s session; returns (existed, its state: NamedSession.take)."""
        record = self._table.get((tenant, name))
        if record is None:
            return False, ([], 0)
        if record.busy:
            raise SessionBusy(f"session {name!r} is busy with another request")
        held = record.take()
        if forget:
            del self._table[record.key]
        return True, held

    def clear(self) -> list[Any]:
        held = [r.session for r in self._table.values() if r.session is not None]
        self._table.clear()
        return held
