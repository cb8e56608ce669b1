"""A start says where it is: /health names the phase (downloading, converting, loading, warming) while
it lasts, a terminal sees one line redrawn, a log a line per phase; and `serve` finds the model on this
machine before anything starts, or downloads it once it listens."""

from __future__ import annotations

import asyncio
import io
import threading

import aiohttp
import pytest
from huggingface_hub import constants

from http_daemon import TEST_ENGINE, serving
from kvfork.server.launch import model_source as source
from kvfork.server.watch.start_progress import StartProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def health(http, url: str) -> tuple[int, dict]:
    async with http.get(url + "/health") as r:
        return r.status, await r.json()


async def test_health_names_each_phase_of_a_start_and_the_memory_plan_once_ready(tiny_model_dir):
    folder = tiny_model_dir("llama")
    steps = {phase: threading.Event() for phase in ("downloading", "converting", "done")}
    go = {phase: threading.Event() for phase in steps}

    def fetch(progress: StartProgress) -> str:  # a download and a conversion, each held until the test lets it go
        for phase in ("downloading", "converting"):
            progress.enter(phase, "tiny")
            steps[phase].set()
            go[phase].wait(30)
        return folder

    async with serving("org/not-yet-here", load=False) as d, aiohttp.ClientSession() as http:
        d.fetch = fetch
        loading = asyncio.create_task(d.load())
        for phase in ("downloading", "converting"):
            assert await asyncio.to_thread(steps[phase].wait, 30)
            status, body = await health(http, d.url)
            assert (status, body["status"], body["phase"]) == (503, "loading", phase)
            assert body["error"]["code"] == "not_ready"  # the OpenAI error body clients read stays
            go[phase].set()
        await loading
        status, body = await health(http, d.url)
        assert (status, body["status"], body["phase"]) == (200, "ok", "ready")
        assert body["memory"]["kv_budget_bytes"] == TEST_ENGINE["kv_budget_bytes"]
        assert d.model == folder and d.state.served_names == ["not-yet-here"]


def test_a_log_gets_a_line_per_phase_and_a_terminal_one_line_redrawn():
    log = io.StringIO()
    progress = StartProgress(log)
    progress.enter("loading", "tiny")
    progress.enter("warming", "prompts.json")
    progress.enter("ready")
    lines = log.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["kvfork: loading tiny", "kvfork: warming prompts.json"]

    async def redraws():
        screen = Terminal()
        progress = StartProgress(screen)
        progress.start()
        progress.enter("loading", "tiny")
        await asyncio.sleep(0.6)
        progress.enter("ready")
        return screen.getvalue()

    text = asyncio.run(redraws())
    assert "\n" not in text and text.count("\r\x1b[2Kkvfork: ") >= 2 and "loading tiny (0 s)" in text
    assert text.endswith("\r\x1b[2K")  # the line is cleared once ready


def test_the_model_is_found_on_this_machine_before_anything_starts(tiny_model_dir, tmp_path, monkeypatch):
    folder = tiny_model_dir("llama")
    assert source.model_source(folder) == (folder, None)
    with pytest.raises(FileNotFoundError):
        source.model_source(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="no config.json"):
        source.model_source(str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # an offline hub cannot give what it lacks
    with pytest.raises(FileNotFoundError):
        source.model_source("no-such-org/no-such-model")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online: downloaded once the daemon listens
    name, fetch = source.model_source("no-such-org/no-such-model")
    assert name == "no-such-org/no-such-model" and fetch is not None


def test_a_default_model_not_converted_yet_is_fetched_after_listening(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORK_HOME", str(tmp_path))
    folder, fetch = source.model_source(None)
    assert folder.startswith(str(tmp_path)) and fetch is not None
