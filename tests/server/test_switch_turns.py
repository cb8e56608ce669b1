"""Model switches between tenants (server/pool/turns.py), as pure decisions over every small case: a switch
waits for the other tenants' requests on the model it unloads, and a tenant's switches that unload another
tenant's model are --model-switch-interval apart, while its own are never held back."""

from __future__ import annotations

import itertools

from kvfork.server.pool.turns import SwitchTurns, disrupts, others_use, waits_for

TENANTS = ("a", "b")


def test_waits_for_exactly_the_other_tenants_running_requests():
    for counts in itertools.product(range(3), repeat=len(TENANTS)):
        users = dict(zip(TENANTS, counts))
        for tenant in (*TENANTS, "c"):
            assert waits_for(tenant, users) == any(n for t, n in users.items() if t != tenant)
        assert not waits_for(None, users)  # an idle unload (--model-ttl) runs on nobody's behalf


def test_another_tenants_model_is_one_it_runs_or_took_last():
    for counts in itertools.product(range(2), repeat=len(TENANTS)):
        users = dict(zip(TENANTS, counts))
        for last in (None, *TENANTS):
            for tenant in TENANTS:
                expected = any(n and t != tenant for t, n in users.items()) or last not in (None, tenant)
                assert others_use(tenant, users, last) == expected
                assert disrupts(tenant, [({}, None), (users, last)]) == expected
    assert not disrupts("a", [])  # room to spare: nothing unloads


def test_a_tenant_switches_another_tenants_model_once_per_interval():
    turns = SwitchTurns(10.0)
    assert turns.wait("a", True, 100.0) == 0.0  # its first
    turns.charge("a", 100.0)
    assert turns.wait("a", True, 104.0) == 6.0  # held back until the interval has passed
    assert turns.wait("a", False, 104.0) == 0.0  # unloading its own model is never held back
    assert turns.wait("b", True, 104.0) == 0.0  # another tenant has its own turns
    assert turns.wait("a", True, 110.0) == 0.0
    assert SwitchTurns(0.0).wait("a", True, 0.0) == 0.0
