"""A failing test never breaks the next one: a backend lent by backend_fixtures.lent takes back every
session its test opened, passed or failed; a test that passed with sessions open fails on its own, and
the backend the next test gets is clean (a fresh one after a failure or a leak)."""

from __future__ import annotations

from pathlib import Path

INNER_TESTS = '''
lent = []


def test_fails_with_sessions_open(backend):
    lent.append(backend)
    s = backend.open_session()
    backend.prefill([s], [[5, 6, 7]])
    backend.clone(s, 3)
    assert False, "on purpose"


def test_the_next_gets_a_clean_backend(backend):
    assert backend is not lent[0]  # reset after the failure
    assert backend.live_sessions() == 0 and backend.total_bytes() == 0


def test_passes_but_leaks(backend):
    lent.append(backend)
    backend.prefill([backend.open_session()], [[5]])
    backend.open_session()


def test_the_one_after_the_leak_too(backend):
    assert backend is not lent[1]
    assert backend.live_sessions() == 0 and backend.total_bytes() == 0
'''


def test_a_failure_inside_the_fixture_leaves_the_next_test_unaffected(pytester, monkeypatch):
    """On the scripted backend (a pytest of its own starts in a second, not the ten torch takes)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # backend_fixtures, scripted_backend
    pytester.makeconftest('''
import pytest

from backend_fixtures import lent
from scripted_backend import ScriptedBackend

pytest_plugins = ("backend_fixtures",)


def scripted():
    b = ScriptedBackend()
    b.load("scripted")
    return b


@pytest.fixture
def backend(request):
    yield from lent(request, "scripted", scripted)
''')
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_fails_with_sessions_open*on purpose*"])
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_passes_but_leaks*",
                                 "*test_inner.py::test_passes_but_leaks leaked 2 sessions*"])
    result.stdout.no_fnmatch_line("*ERROR at teardown of test_fails_with_sessions_open*")  # its failure says it all
