"""Grammars under hostile schemas (issue 22's findings 5 and 8): the cache is per scope, a compile past its
timeout is stopped (its process killed), and llguidance's limits hold for every matcher."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess

import pytest

from kvfork.server.engine.api import Scope
from kvfork.server.generate.grammar import PARSER_LIMITS, CompileCooling, GrammarCompiler, GrammarError, JsonSchema
from kvfork.server.generate.grammar_worker import read_message, write_message
from kvfork.server.generate.isolated import module_command
from kvfork.server.guard.errors import ApiError

WIDE = JsonSchema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)}})
SMALL = JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}}})
LOWEST_PRIORITY = 19  # the highest nice value


@pytest.fixture
def hf(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


async def test_the_grammar_cache_is_per_scope(hf):
    grammars = GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=30.0, child_env=os.environ)
    try:
        a = await grammars.compile(SMALL, Scope("tenant-a"))
        assert await grammars.compile(SMALL, Scope("tenant-a")) is a
        b = await grammars.compile(SMALL, Scope("tenant-b"))  # another tenant compiles its own
        assert b is not a
        assert await grammars.compile(SMALL, Scope("tenant-a", "salt")) is not a  # and another salt
    finally:
        grammars.close()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def test_a_compile_past_its_timeout_stops_and_another_compiles_meanwhile(hf):
    grammars = GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=0.3, child_env=os.environ)
    try:
        await grammars.compile(SMALL, Scope("warm"))  # both compile processes' start is not a grammar's cost
        slow = [asyncio.ensure_future(grammars.compile(WIDE, Scope("hostile"))) for _ in range(3)]
        assert await grammars.compile(SMALL, Scope("innocent")) is not None  # a thread is always free for it
        for task, status in zip(slow, (400, 429, 429)):  # the first times out, the others find the tenant cooling
            with pytest.raises(ApiError) as refused:
                await task
            assert refused.value.status == status and "--grammar-compile-timeout" in refused.value.message
        before = _cpu_s()
        await asyncio.sleep(2.0)
        # nothing goes on compiling in this process once the 400s are out (on main: a thread burned on)
        assert _cpu_s() - before < 0.2
    finally:
        grammars.close()


async def test_a_tenant_whose_compile_timed_out_has_its_next_large_grammars_refused(hf):
    """Compile seconds past the timeout are a budget: the tenant cools down, another does not (issue 45)."""
    grammars = GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=0.3, child_env=os.environ)
    try:
        with pytest.raises(GrammarError):
            await grammars.compile(WIDE, Scope("hostile"))
        with pytest.raises(CompileCooling) as cooling:  # refused before any compile process runs
            await grammars.compile(WIDE, Scope("hostile"))
        assert cooling.value.status == 429 and cooling.value.code == "rate_limit_exceeded"
        assert "--grammar-compile-timeout" in cooling.value.message
        assert 0 < cooling.value.retry_after <= 10 * 0.3
        assert await grammars.compile(SMALL, Scope("hostile")) is not None  # small grammars build as before
        with pytest.raises(GrammarError):  # another tenant's compile is tried
            await grammars.compile(WIDE, Scope("innocent"))
    finally:
        grammars.close()


def test_the_compile_process_runs_below_the_daemons_cpu_priority(hf):
    """A compile takes what CPU the daemon leaves: another tenant's decode keeps its core (issue 45)."""
    if os.getpriority(os.PRIO_PROCESS, 0) >= LOWEST_PRIORITY:
        pytest.skip("the tests run at the lowest CPU priority already (nice 19): none is below it")
    grammars = GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=30.0, child_env=os.environ)
    proc = subprocess.Popen(module_command("kvfork.server.generate.grammar_worker"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        write_message(proc.stdin, grammars.setup())
        assert read_message(proc.stdout) == {"ready": True}
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) > os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        grammars.close()


def test_llguidance_limits_are_set_and_errors_are_terse():
    assert PARSER_LIMITS["verbose_errors"] is False
    for name in ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items", "max_lexer_states",
                 "max_grammar_size"):
        assert PARSER_LIMITS[name] > 0
