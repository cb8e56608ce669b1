"""Shared fixtures: tiny random model folders, made once per test run.

The tests sit in one folder per layer (README.md there); the helpers they import as top-level modules
(tiny_models, engine_harness, http_daemon, ...) sit here, on sys.path by pyproject.toml's `pythonpath`."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import tolerance
from scripted_backend import Gate
from sdk_clients import SdkClients
from tiny_models import ARCHS, LONG_CONTEXT, write_model
from kvfork.backends.home import kvfork_home as kvfork_home_of_user

# backend_fixtures: its report hook (a lent backend's cleanup); tiers: the fast tier's report, leaks named
pytest_plugins = ("backend_fixtures", "tiers", "pytester")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A function arch -> folder; each arch is written once per run."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = str(write_model(tmp_path_factory.mktemp(arch), arch))
        return made[arch]

    return get


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory) -> str:
    """The long tests' tiny llama (tiny_models.LONG_CONTEXT: a 128k context, one layer), written once per run."""
    return str(write_model(tmp_path_factory.mktemp("llama-128k"), "llama", **LONG_CONTEXT))


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory):
    """A function (arch, layout) -> folder of a tiny hybrid model (tiny_hybrid_models.py), written
    once per run; the same weights in every layout. The MLX-only families come in mlx layout whatever
    the layout asked."""
    from tiny_hybrid_models import MLX_ONLY_WRITERS, write_hybrid_model

    made: dict[tuple[str, str], str] = {}

    def get(arch: str, layout: str = "hf") -> str:
        if arch in MLX_ONLY_WRITERS:
            layout = "mlx"
        if (arch, layout) not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-{layout}")
            made[arch, layout] = str(MLX_ONLY_WRITERS[arch](folder) if arch in MLX_ONLY_WRITERS
                                     else write_hybrid_model(folder, arch, layout))
        return made[arch, layout]

    return get



# One temporary KVFORK_HOME for the run, set before anything reads it: the disk tier never writes
# under the user's. Its `models` is the user's (a link), so the default model is fetched once, as
# before, and every test sees the same model folder.
_USER_MODELS = kvfork_home_of_user() / "models"
_USER_MODELS.mkdir(parents=True, exist_ok=True)
_HOME = Path(tempfile.mkdtemp(prefix="kvfork-test-home-"))
(_HOME / "models").symlink_to(_USER_MODELS, target_is_directory=True)
os.environ["KVFORK_HOME"] = str(_HOME)
atexit.register(shutil.rmtree, _HOME, True)  # removes the link, never what it points to


@pytest.fixture
async def http():
    """An HTTP client session for a test that talks to a daemon (http_daemon.serving)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def sdk():
    """OpenAI and Anthropic SDK clients for a test (`sdk.openai(daemon)`), closed at its end."""
    clients = SdkClients()
    yield clients
    await clients.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """The tiny llama's PromptTokenizer."""
    from kvfork.server.text.tokenizer import PromptTokenizer

    return PromptTokenizer.load(tiny_model_dir("llama"))


@pytest.fixture(autouse=True)
def gates_opened():
    """A test that holds the runner in a Gate opens it: passing by the gate's timeout is waiting, not testing."""
    yield
    expired, Gate.expired[:] = list(Gate.expired), []
    assert not expired, "; ".join(expired)


@pytest.fixture(autouse=True)
def kvfork_home():
    """The run's KVFORK_HOME, with an empty disk tier ($KVFORK_HOME/kv) for every test."""
    shutil.rmtree(_HOME / "kv", ignore_errors=True)
    yield _HOME
    shutil.rmtree(_HOME / "kv", ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    """The largest difference each kind of comparison showed against its bound, and the nearest tie a
    greedy step met (tolerance.py): how close this machine's sums came to failing."""
    if not tolerance.worst:
        return
    terminalreporter.section("tolerances: largest difference against the bound, per comparison kind")
    for kind, (ratio, diff, allowed, where) in sorted(tolerance.worst.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"{kind.value:34s} {diff:9.3g} of {allowed:9.3g} ({ratio:6.1%})  {where}")
    tie, where = tolerance.closest_tie
    if where:
        terminalreporter.write_line(f"{'nearest tie of a greedy step':34s} margin {tie:.3g}x twice the bound  {where}")
