"""The daemon's Services over its Models (server/common/state.py), without a daemon: what a route naming no model
reads, and a stored response's session forgotten in every loaded model."""

from __future__ import annotations

import pytest

from kvfork.server.common.config import ServerConfig
from kvfork.server.common.state import Services
from kvfork.server.engine.api import SessionBusy
from kvfork.server.guard.errors import ApiError
from kvfork.server.watch.metrics import Registry


class Forgetting:
    """An engine as `forget_session` reads it: the sessions it deleted, or busy."""

    def __init__(self, busy: bool = False):
        self.busy, self.deleted = busy, []

    def delete_session(self, name: str, tenant: str) -> bool:
        if self.busy:
            raise SessionBusy("running")
        self.deleted.append((name, tenant))
        return True


class NoneLoaded:
    """A pool of models none of which is loaded (the Models protocol, as far as Services reads it)."""

    def __init__(self, engines: list):
        self.loaded = engines

    def recent(self):
        return None

    def engines(self) -> list:
        return self.loaded


def services(models) -> Services:
    made = Services(ServerConfig(), Registry(), models)
    made.close()  # its image decoder's threads: nothing here decodes
    return made


def test_a_route_naming_no_model_hears_not_ready_while_none_is_loaded():
    with pytest.raises(ApiError) as refused:
        services(NoneLoaded([])).current()
    assert refused.value.status == 503 and refused.value.code == "not_ready"


def test_a_forgotten_session_is_deleted_in_every_loaded_model_a_busy_one_left_to_its_engine():
    free, busy = Forgetting(), Forgetting(busy=True)
    services(NoneLoaded([busy, free])).forget_session("chat", "tenant-a")
    assert free.deleted == [("chat", "tenant-a")] and busy.deleted == []
