"""The suite's tiers, as a pytest plugin (conftest.py registers it).

A test's markers put it in a tier: `long` (slow by nature: 64k+ prompts, the soak's long wave) and
`distributed` (two ranks) each have a tier and a make target of their own; every other test is in the
fast tier, `make test`, which a developer runs before every push. So that the fast tier stays fast
with nobody watching it, the run ends by naming each fast-tier test that took longer than
`fast_tier_limit_s` (setup, call and teardown together) and the marker that would move it. It is a
report, never a failure: a loaded machine must not fail a run for its speed.

The same plugin makes leaks fail where they happen: the objects that exist once the tests are
collected are frozen out of the collector, so a collection after each test costs microseconds, and
what that test left unclosed (an SDK client, a transport, an event loop) is found in its own teardown
and, with pyproject.toml's warning filters, fails it."""

from __future__ import annotations

import gc
from collections import defaultdict

import pytest

TIER_MARKERS = ("long", "distributed")


def pytest_addoption(parser):
    parser.addini("fast_tier_limit_s", "a fast-tier test slower than this (seconds) is named at the end of the run",
                  default="30")


def pytest_configure(config):
    config.pluginmanager.register(FastTierTimes(float(config.getini("fast_tier_limit_s"))), "fast_tier_times")


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def leaks_found_in_their_own_test():
    yield
    gc.collect()


class FastTierTimes:
    """Each fast-tier test's seconds (setup, call and teardown), and the report of those over the limit."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        if not any(marker in report.keywords for marker in TIER_MARKERS):
            self.seconds[report.nodeid] += report.duration

    def pytest_terminal_summary(self, terminalreporter):
        slow = sorted(((s, nodeid) for nodeid, s in self.seconds.items() if s > self.limit_s), reverse=True)
        if not slow:
            return
        terminalreporter.section(f"fast-tier tests over {self.limit_s:g} s: mark each @pytest.mark.long "
                                 "(make test-long) or make it cheaper")
        for seconds, nodeid in slow:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
