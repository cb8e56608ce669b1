"""Where a setting comes from: a flag, KVFORK_<FLAG>, a --config TOML file, its default, in that order;
sizes with units, vLLM's names, --help's sections, --print-config, and each bad input a one-line exit 2
naming what to change, before anything loads. And a daemon that takes its keys from the environment and
its config file, with none on its command line."""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvfork.server.cli import read_settings, serve_parser
from kvfork.server.settings import parse_size
from test_cli import kvfork, started


def settings(argv: list[str], env: dict[str, str] | None = None):
    _, config, engine, found = read_settings(serve_parser(), argv, env or {})
    return config, engine, found


@pytest.mark.parametrize("text, size", [("16GiB", 16 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000),
                                        ("16G", 16 * 1024**3), ("4 KiB", 4096), ("1048576", 1048576), ("2tb", 2e12)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_a_flag_wins_over_the_environment_which_wins_over_the_file(tmp_path):
    file = tmp_path / "kvfork.toml"
    file.write_text('max-context = 1024\ninference_slots = 3\nprefix-cache-disk-bytes = "2GiB"\nfollow = false\n'
                    'served-model-name = ["a", "b"]\n')
    env = {"KVFORK_MAX_CONTEXT": "2048", "KVFORK_PREFIX_CACHE_BYTES": "512MiB", "KVFORK_CONFIG": str(file)}
    config, engine, found = settings(["--max-num-seqs", "5"], env)
    assert (engine.max_context, engine.inference_slots, engine.prefix_cache_bytes) == (2048, 5, 512 * 1024**2)
    assert (engine.prefix_cache_disk_bytes, engine.follow, config.served_model_name) == (2 * 1024**3, False, ["a", "b"])
    assert found.sources["inference_slots"] == "flag" and found.sources["max_context"] == "env KVFORK_MAX_CONTEXT"
    assert found.sources["follow"] == f"file {file}" and "queue_timeout" not in found.sources
    assert found.notices == []
    _, engine, found = settings(["--max-model-len", "4096", "--kv-budget-bytes", "1.5GiB"], env)
    assert engine.max_context == 4096 and engine.kv_budget_bytes == 1536 * 1024**2
    assert found.sources["max_context"] == "flag, over KVFORK_MAX_CONTEXT"
    assert found.notices == ["--max-context on the command line overrides KVFORK_MAX_CONTEXT (a flag wins over the "
                             "environment, which wins over --config)"]


def test_lists_and_booleans_from_the_environment():
    config, engine, _ = settings([], {"KVFORK_API_KEY": "k1, k2", "KVFORK_FOLLOW": "off",
                                      "KVFORK_ACCEPT_ANY_MODEL": "1", "KVFORK_MAX_CONTEXT": ""})
    assert config.api_key == ["k1", "k2"] and config.accept_any_model and not engine.follow
    assert engine.max_context is None  # set but empty: unset


def test_help_is_grouped_model_first_limits_last_with_each_default_once():
    text = kvfork("serve", "--help").stdout
    sections = [line.rstrip(":") for line in text.splitlines() if re.fullmatch(r"[a-z][a-z ]+:", line)]
    assert sections == ["options", "model and device", "serving", "scheduling", "reuse", "limits"]
    assert text.index("--model") < text.index("--host") < text.index("--prefix-cache-entries") < text.index(
        "--max-body-bytes")
    assert "--max-model-len" in text and "--max-num-seqs" in text and "KVFORK_" in text
    flat = " ".join(text.split())
    assert "(default: 16 GiB)" in flat and "(default: 16 MiB)" in flat  # sizes read as sizes
    assert "(default: None)" not in flat and "None:" not in flat
    assert all(chunk.count("(default:") <= 1 for chunk in re.split(r"\n  -", text))


def test_print_config_shows_each_value_and_its_source_as_a_file_it_reads_back(tmp_path):
    file = tmp_path / "kvfork.toml"
    file.write_text('queue-timeout = 12.5\napi-key = ["from-file"]\n')
    done = kvfork("serve", "--config", str(file), "--print-config", "--max-context", "4096",
                  env={**os.environ, "KVFORK_KV_BUDGET_BYTES": "3GiB"})
    assert done.returncode == 0, done.stderr
    lines = {line.split("#")[0].strip(): line.split("#")[-1].strip() for line in done.stdout.splitlines()
             if "=" in line and not line.startswith("#")}
    assert lines["max-context = 4096"] == "flag" and lines['kv-budget-bytes = "3GiB"'] == "env KVFORK_KV_BUDGET_BYTES"
    assert lines["queue-timeout = 12.5"] == f"file {file}" and lines["max-queue = 256"] == "default"
    assert "from-file" not in done.stdout and "# api-key = (1 hidden)" in done.stdout  # secrets never printed
    again = tmp_path / "again.toml"
    again.write_text(done.stdout)
    # every value but the secret, which is never printed
    values = lambda out: [line.split("#")[0].strip() for line in out.splitlines() if "api-key" not in line]  # noqa
    assert values(kvfork("serve", "--config", str(again), "--print-config").stdout) == values(done.stdout)


@pytest.mark.parametrize("file, env, args, says", [
    ("max-contxt = 8\n", {}, [], "unknown key 'max-contxt' (did you mean 'max-context'?)"),
    ("", {}, ["--kv-budget-bytes", "16 gigs"], "--kv-budget-bytes: not a size: '16 gigs'"),
    ('prefix-cache-bytes = "lots"\n', {}, [], "prefix-cache-bytes: not a size: 'lots'"),
    ("", {"KVFORK_MAX_CONTEXT": "8k"}, [], "KVFORK_MAX_CONTEXT: expected int, got '8k'"),
    ("", {"KVFORK_FOLLOW": "maybe"}, [], "KVFORK_FOLLOW: expected true or false"),
    ("", {"KVFORK_BACKEND": "tpu"}, [], "KVFORK_BACKEND: 'tpu' is not one of auto, mlx, torch"),
    ("", {"KVFORK_INFERENCE_SLOTS": "0"}, [], "--inference-slots: must be >= 1"),
    ("max-context = 1.5\n", {}, [], "max-context: expected int, got 1.5"),
    ("[server]\nport = 1\n", {}, [], "unknown key 'server'"),
    ("port = \n", {}, [], "cannot read"),
])
def test_bad_input_exits_2_with_one_line_naming_what_to_change(tmp_path, file, env, args, says):
    config = tmp_path / "kvfork.toml"
    config.write_text(file)
    done = kvfork("serve", "--config", str(config), *args, env={**os.environ, **env})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfork serve: error:") and says in lines[0], lines


@pytest.mark.parametrize("file", ['metrics-key = ["s3cret-value"]\n', 'api-key = {key = "s3cret-value"}\n',
                                  'metrics-key = {value = "s3cret-value"}\n'])
def test_a_secret_of_the_wrong_type_is_not_echoed(tmp_path, file):
    from kvfork.server.common.config import ServerConfig
    from kvfork.server.settings import read_config_file

    config = tmp_path / "kvfork.toml"
    config.write_text(file)
    with pytest.raises(ValueError) as e:
        read_config_file(str(config), ServerConfig)
    assert "s3cret" not in str(e.value) and "not shown" in str(e.value)


def test_a_key_on_the_command_line_works_with_a_warning():
    done = kvfork("serve", "--api-key", "visible-key", "--print-config")
    assert done.returncode == 0 and "warning: --api-key is on the command line" in done.stderr
    assert "KVFORK_API_KEY" in done.stderr and "visible-key" not in done.stderr + done.stdout


def status_of(url: str, key: str | None = None, body: bytes | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_daemon_takes_its_keys_from_the_environment_and_its_config_file(tiny_model_dir, tmp_path):
    file = tmp_path / "kvfork.toml"
    file.write_text(f'model = "{tiny_model_dir("llama")}"\nbackend = "mlx"\nport = 0\nmetrics-key = "file-metrics"\n'
                    'served-model-name = ["tiny"]\nkv-budget-bytes = "64MiB"\n')
    env = {**os.environ, "KVFORK_API_KEY": "env-key-1,env-key-2", "KVFORK_CONFIG": str(file)}
    with started(env=env) as (process, text):
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text).group(1)  # type: ignore[union-attr]
        # the plan (and the tokens it holds) and why
        assert re.search(r"KV budget 0\.06 GiB = \S+ tokens in \S+ \([^)]+\): --kv-budget-bytes 0\.06 GiB "
                         r"\(the device holds", text), text
        assert "warning" not in text
        assert status_of(url + "/metrics") == 401 and status_of(url + "/metrics", "file-metrics") == 200
        assert status_of(url + "/metrics", "env-key-1") == 401  # a tenant's key does not open /metrics
        body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
        for key, status in ((None, 401), ("env-key-2", 200), ("file-metrics", 401)):
            assert status_of(url + "/v1/chat/completions", key, body) == status
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"env-key" not in cmdline and b"file-metrics" not in cmdline
