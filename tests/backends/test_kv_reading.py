"""kv_reading.c's build and load (backends/kv_reading.py): where it cannot be built, one log line says why and the
backends read through their own operations; and a build is named by its source and CPU, used again and replaces
the others. What it computes: test_integer_reading.py (torch's rows) and test_mlx_kv_storage.py (MLX's)."""

from __future__ import annotations

import logging
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from kvfork.backends import device_memory, kv_reading


def test_where_it_cannot_be_built_the_log_says_why(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(kv_reading.shutil, "which", lambda name: None)
    with caplog.at_level(logging.INFO, logger="kvfork.backends"):
        assert kv_reading.library.__wrapped__() is None
    assert "no C compiler" in caplog.text
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: error: this CPU has no AVX2' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setattr(kv_reading.shutil, "which", lambda name: str(failing))
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path / "home"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvfork.backends"):
        assert kv_reading.library.__wrapped__() is None
    assert "this CPU has no AVX2" in caplog.text


def test_a_build_is_named_by_its_source_and_cpu_used_again_and_replaces_the_others(tmp_path, monkeypatch):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no cc")
    calls = []
    run = subprocess.run

    def counted(*args, **kwargs):
        calls.append(args)
        return run(*args, **kwargs)

    monkeypatch.setattr(kv_reading.subprocess, "run", counted)
    try:
        first = kv_reading.build(cc, tmp_path)
    except subprocess.CalledProcessError:
        pytest.skip("kv_reading.c does not build for this CPU")
    assert kv_reading.build(cc, tmp_path) == first and len(calls) == 1
    monkeypatch.setattr(kv_reading, "cpu_identity", lambda: "another CPU")
    other = kv_reading.build(cc, tmp_path)
    assert other != first and len(calls) == 2
    assert [p.name for p in tmp_path.iterdir()] == [other.name]  # the earlier build is removed


@pytest.mark.parametrize("cpuinfo,flags", [
    ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\nbugs\t\t: spectre_v1\n", {"fpu", "sse", "avx2", "avx512f"}),
    ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve\nCPU part\t: 0xd40\n", {"fp", "asimd", "sve"}),
    ("processor\t: 0\n", set())])
def test_a_build_is_named_by_the_instruction_sets_x86_or_arm_lists(monkeypatch, cpuinfo, flags):
    """A build for -march=native runs only on CPUs with what it was built for: its name holds the CPU's
    instruction sets, x86's `flags` line or Arm's `Features`."""
    monkeypatch.setattr(device_memory, "Path", lambda path: SimpleNamespace(read_text=lambda: cpuinfo))
    assert device_memory.cpu_flags() == flags
    assert kv_reading.cpu_identity().split()[1:] == sorted(flags)
