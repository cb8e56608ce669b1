"""Stored responses, for `previous_response_id`: in memory, capped, oldest out first.

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
  key its id is unknown (404), and its session is that tenant's (sessions.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from server.errors import ApiError
from server.api.responses.protocol import Response


@dataclass
class Stored:
    response: Response  # as the client got it, for GET /v1/responses/{id}
    messages: list[dict[str, Any]]
    session: str | None  # the named session of its conversation, once one is open
    tenant: str = ""  # whose it is: another tenant's requests find no response of that id


class ResponseStore:
    def __init__(self, max_responses: int, forget_session: Callable[[str, str], None]):
        self.max_responses = max_responses
        self.forget_session = forget_session
        self._responses: OrderedDict[str, Stored] = OrderedDict()  # oldest first
        self._heads: dict[str, str] = {}  # session → the response it holds (or is computing)

    def __len__(self) -> int:
        return len(self._responses)

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
        self._responses[response.id] = Stored(response, messages, session, tenant)
        while len(self._responses) > self.max_responses:
            self._drop(*self._responses.popitem(last=False))

    def delete(self, response_id: str, tenant: str = "") -> None:
        self.get(response_id, tenant)
        self._drop(response_id, self._responses.pop(response_id))

    def _drop(self, response_id: str, stored: Stored) -> None:
        if stored.session is not None and self._heads.get(stored.session) == response_id:
            del self._heads[stored.session]
            self.forget_session(stored.session, stored.tenant)
