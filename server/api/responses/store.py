"""Stored responses, for `previous_response_id`: in memory, capped per tenant, oldest out first.

A stored response keeps its conversation as chat messages (everything before it
and its own output, without the instructions, which OpenAI does not carry over).
Continuing it renders that history plus the new input through the chat path.

Warm resume rides on named sessions, opened only by conversations that use
`previous_response_id` (an agent that resends its whole history each turn, as the
Agents SDK does by default, keeps the prefix cache: a named session that starts
cold is not offered it). Rules:
- the first continuation of a response opens a session, named after itself;
  each response that continues the response the session last ended on (its
  head) runs in it, so the engine computes only the new input;
- one continuation per head: a second request continuing the same response, at
  once or later, runs without a session and finds its prefix in the prefix
  cache instead (never a 409);
- a continuation that fails or is cut off gives the head back;
- a response dropped past the cap or deleted that is still its session's head
  takes the session with it (its KV state is freed);
- a stored response belongs to the tenant that made it: under another tenant's
  key its id is unknown (404), and its session is that tenant's (sessions.py);
- each tenant has its own quota, in responses (--max-stored-responses) and in
  bytes (--max-stored-response-bytes): storing past either drops that tenant's
  oldest, never another tenant's. The bytes are exact: a response's conversation
  shares its message objects with the one it continues, and each message is
  counted once, however many stored responses hold it. A request whose input
  alone is over the byte quota is refused before it runs (`check_room`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
from aiohttp import web

from kvfork.server.api.responses.protocol import Response
from kvfork.server.guard.errors import ApiError
from kvfork.server.guard.limits import over


@dataclass
class Stored:
    response: Response  # as the client got it, for GET /v1/responses/{id}
    messages: list[dict[str, Any]]
    session: str | None  # the named session of its conversation, once one is open
    tenant: str = ""  # whose it is: another tenant's requests find no response of that id
    nbytes: int = 0  # the response's own JSON (its messages are counted in the store's table of them)


@dataclass
class TenantUse:
    responses: OrderedDict[str, None] = field(default_factory=OrderedDict)  # its ids, oldest first
    nbytes: int = 0  # its responses and the messages they hold, each message once


def _size(value: Any) -> int:
    return len(msgspec.json.encode(value))


class ResponseStore:
    def __init__(self, max_responses: int, forget_session: Callable[[str, str], None], max_bytes: int = 1 << 62):
        """`max_responses` and `max_bytes` are each tenant's quota."""
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.forget_session = forget_session
        self._responses: dict[str, Stored] = {}
        self._tenants: dict[str, TenantUse] = {}
        self._messages: dict[int, list] = {}  # id(message) -> [message, stored responses holding it, bytes]
        self._heads: dict[str, str] = {}  # session → the response it holds (or is computing)

    def __len__(self) -> int:
        return len(self._responses)

    def use(self, tenant: str) -> TenantUse:
        return self._tenants.get(tenant) or TenantUse()

    def check_room(self, messages: list[dict[str, Any]], tenant: str) -> None:
        """A 400 when a conversation alone (before its output) would be over the tenant's byte quota: storing
        it would drop every other response of the tenant and still not fit."""
        need = sum(held[2] if (held := self._messages.get(id(m))) is not None else _size(m) for m in messages)
        if need > self.max_bytes:
            raise over("input", f"the conversation to store is {need:,} bytes; send store: false, or less",
                       self.max_bytes, "--max-stored-response-bytes")

    def get(self, response_id: str, tenant: str = "", param: str = "response_id") -> Stored:
        stored = self._responses.get(response_id)
        if stored is None or stored.tenant != tenant:  # another tenant's: as if there were none
            raise ApiError(404, f"no stored response with id {response_id!r}", code="previous_response_not_found"
                           if param == "previous_response_id" else "response_not_found", param=param)
        return stored

    def history(self, response_id: str, tenant: str = "") -> list[dict[str, Any]]:
        return self.get(response_id, tenant, "previous_response_id").messages

    def claim(self, previous: str, response_id: str) -> str | None:
        """The session `response_id`, continuing `previous`, runs in; None: run without one."""
        stored = self._responses[previous]
        if stored.session is None:  # the conversation's first continuation opens its session
            stored.session = "resp-" + response_id
        elif self._heads.get(stored.session) != previous:
            return None
        self._heads[stored.session] = response_id
        return stored.session

    def give_back(self, session: str, response_id: str, previous: str) -> None:
        """`response_id` ended without being stored: its session's head is `previous` again."""
        if self._heads.get(session) == response_id:
            self._heads[session] = previous

    def put(self, response: Response, messages: list[dict[str, Any]], session: str | None, tenant: str = "") -> None:
        """Store it; past the tenant's quota its oldest go (never the one just stored)."""
        stored = self._responses[response.id] = Stored(response, messages, session, tenant, _size(response))
        use = self._tenants.setdefault(tenant, TenantUse())
        use.responses[response.id] = None
        use.nbytes += stored.nbytes
        for message in messages:
            held = self._messages.get(id(message))
            if held is None:
                held = self._messages[id(message)] = [message, 0, _size(message)]
                use.nbytes += held[2]
            held[1] += 1
        while len(use.responses) > 1 and (len(use.responses) > self.max_responses or use.nbytes > self.max_bytes):
            self._drop(next(iter(use.responses)))

    def delete(self, response_id: str, tenant: str = "") -> None:
        self.get(response_id, tenant)
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        stored = self._responses.pop(response_id)
        use = self._tenants[stored.tenant]
        del use.responses[response_id]
        use.nbytes -= stored.nbytes
        for message in stored.messages:
            held = self._messages[id(message)]
            held[1] -= 1
            if not held[1]:
                del self._messages[id(message)]
                use.nbytes -= held[2]
        if not use.responses:
            del self._tenants[stored.tenant]
        if stored.session is not None and self._heads.get(stored.session) == response_id:
            del self._heads[stored.session]
            self.forget_session(stored.session, stored.tenant)


RESPONSES = web.AppKey("responses", ResponseStore)  # the daemon's, on its application (server/launch/app.py)
