"""Model switches between tenants, as pure decisions: which tenants' running requests a switch waits for, and
how often one tenant may switch a model another tenant uses.

A switch that unloads a model another tenant used is charged to the tenant whose request asked for it; a
tenant's charged switches are at least --model-switch-interval seconds apart (`SwitchTurns.wait`), so naming
other models again and again cannot keep unloading another tenant's model. A switch unloading only what its
own tenant used (a daemon without keys has one tenant) is never held back. The switch then waits for the other
tenants' requests on the model it unloads to end, whatever --model-switch-timeout says (`waits_for`): only
its own tenant's are cancelled at the timeout.
"""

from __future__ import annotations

from typing import Iterable, Mapping


def others_use(tenant: str, users: Mapping[str, int], last: str | None) -> bool:
    """Whether a model running `users` (requests per tenant), last taken by `last`, is another tenant's."""
    return any(n > 0 and t != tenant for t, n in users.items()) or (last is not None and last != tenant)


def waits_for(tenant: str | None, users: Mapping[str, int]) -> bool:
    """Whether a switch for `tenant` (None: an idle unload) still waits, whatever its timeout, for the requests
    running on the model it unloads: while any of them is another tenant's."""
    return tenant is not None and any(n > 0 and t != tenant for t, n in users.items())


class SwitchTurns:
    """When each tenant last switched a model another tenant used (monotonic seconds)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def wait(self, tenant: str, disrupts: bool, now: float) -> float:
        """Seconds before `tenant` may make a switch that `disrupts` another tenant's model (0: now)."""
        last = self._last.get(tenant)
        if not disrupts or last is None:
            return 0.0
        return max(0.0, last + self.interval_s - now)

    def charge(self, tenant: str, now: float) -> None:
        self._last[tenant] = now
        if len(self._last) > 4096:  # tenants long past their interval need no entry
            self._last = {t: at for t, at in self._last.items() if now - at < self.interval_s}


def disrupts(tenant: str, victims: Iterable[tuple[Mapping[str, int], str | None]]) -> bool:
    """Whether unloading `victims` (each: its running requests per tenant, and who took it last) for `tenant`
    touches another tenant's model."""
    return any(others_use(tenant, users, last) for users, last in victims)
