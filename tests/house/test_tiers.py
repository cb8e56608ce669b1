"""The tiers plugin (tests/tiers.py): the fast tier's slow tests are named with the marker to add, and a
leak fails the test that made it, not the test during which the collector happens to find it."""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW_AND_MARKED = '''
import time

import pytest


def test_unmarked_and_slow():
    time.sleep(0.3)


@pytest.mark.long
def test_slow_in_the_long_tier():
    time.sleep(0.3)


def test_quick():
    pass
'''

LEAKS = '''
import socket


def test_leaves_a_socket_open():
    cycle = [socket.socket()]
    cycle.append(cycle)  # only the collector frees it, and then the socket warns that it was never closed


def test_the_next_test():
    pass
'''


@pytest.fixture
def inner(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # tiers.py
    pytester.makeini("[pytest]\nmarkers =\n    long: the long tier\n    distributed: the distributed tier\n"
                     "filterwarnings =\n    error::ResourceWarning\n"
                     "    error::pytest.PytestUnraisableExceptionWarning\n")
    return pytester


def test_a_slow_fast_tier_test_is_named_with_the_marker_to_add(inner):
    inner.makepyfile(test_inner=SLOW_AND_MARKED)
    result = inner.runpytest_subprocess("-p", "tiers", "-p", "no:cacheprovider", "-o", "fast_tier_limit_s=0.2")
    result.assert_outcomes(passed=3)  # a report, never a failure
    result.stdout.fnmatch_lines(["*fast-tier tests over 0.2 s: mark each @pytest.mark.long*",
                                 "*s  test_inner.py::test_unmarked_and_slow"])
    result.stdout.no_fnmatch_line("*s  test_inner.py::test_slow_in_the_long_tier")
    result.stdout.no_fnmatch_line("*s  test_inner.py::test_quick")


def test_nothing_is_named_when_the_fast_tier_is_fast(inner):
    inner.makepyfile(test_inner=SLOW_AND_MARKED)
    result = inner.runpytest_subprocess("-p", "tiers", "-p", "no:cacheprovider", "-m", "not long")
    result.assert_outcomes(passed=2, deselected=1)
    result.stdout.no_fnmatch_line("*fast-tier tests over*")


def test_a_leak_fails_the_test_that_made_it(inner):
    inner.makepyfile(test_inner=LEAKS)
    result = inner.runpytest_subprocess("-p", "tiers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaves_a_socket_open*"])
    result.stdout.no_fnmatch_line("*ERROR at teardown of test_the_next_test*")
