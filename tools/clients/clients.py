"""The three clients: the npm package and version pinned, how each is configured offline in a
throwaway folder, and the command line of a first and a following turn."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvfork.tools.clients.proxy import ScriptedCall

MODEL = "tiny"  # the name every client asks for; kvfork runs with --accept-any-model anyway
KEY = "kvfork-local"  # a dummy key: kvfork runs without keys, the clients want one to start


@dataclass(frozen=True)
class Client:
    name: str
    package: str
    version: str
    binary: str
    api: str

    def read_tool(self, work: Path) -> ScriptedCall:
        raise NotImplementedError

    def configure(self, root: Path, base_url: str, context: int) -> dict[str, str]:
        """Write the client's configuration under `root` for a model of `context` tokens; returns the
        environment it runs with."""
        raise NotImplementedError

    def command(self, prompt: str, first: bool, work: Path) -> list[str]:
        raise NotImplementedError


def _base_env(root: Path) -> dict[str, str]:
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    return {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
            "NO_COLOR": "1", "TERM": "dumb", "CI": "1"}


class Codex(Client):
    def read_tool(self, work: Path) -> ScriptedCall:
        # Codex reads files through its shell tool; the command is the script's, fixed by the grammar,
        # and runs in Codex's read-only sandbox.
        return ScriptedCall("exec_command", {"cmd": "cat notes.txt"})

    def configure(self, root: Path, base_url: str, context: int) -> dict[str, str]:
        env = _base_env(root)
        # Codex 0.171's own prompt is ~8,800 tokens of SmolLM2's: on an 8k model its multi-agent and
        # goal tools stay off, as a user of a small model would set it.
        small = "\n[features]\ngoals = false\n\n[agents]\nenabled = false\n" if context < 16384 else ""
        codex_home = root / "codex-home"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "config.toml").write_text(f'''model = "{MODEL}"
model_provider = "kvfork"
model_context_window = {context}
check_for_update_on_startup = false
approval_policy = "never"
sandbox_mode = "read-only"

[model_providers.kvfork]
name = "kvfork"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "KVFORK_API_KEY"
request_max_retries = 0
stream_max_retries = 0
# a CPU prefill of Codex's ~9k-token prompt can outlast the 5-minute default; kvfork's keep-alives
# are SSE comments, which Codex's idle timer does not count
stream_idle_timeout_ms = 3600000

[analytics]
enabled = false
{small}''')
        return env | {"CODEX_HOME": str(codex_home), "KVFORK_API_KEY": KEY}

    def command(self, prompt: str, first: bool, work: Path) -> list[str]:
        if first:
            return [self.binary, "exec", "--skip-git-repo-check", "-C", str(work), prompt]
        return [self.binary, "exec", "resume", "--last", "--skip-git-repo-check", prompt]


@dataclass(frozen=True)
class ClaudeCode(Client):
    flags: tuple[str, ...] = ()  # more of its own, before the allowed tools (run.py: the two-projects step)

    def read_tool(self, work: Path) -> ScriptedCall:
        return ScriptedCall("Read", {"file_path": str(work / "notes.txt")})

    def configure(self, root: Path, base_url: str, context: int) -> dict[str, str]:
        env = _base_env(root)
        config = root / "claude-config"
        config.mkdir(exist_ok=True)
        return env | {"CLAUDE_CONFIG_DIR": str(config), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": KEY,
                      "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
                      "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
                      "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1", "API_TIMEOUT_MS": "3600000",
                      "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}

    def command(self, prompt: str, first: bool, work: Path) -> list[str]:
        # the prompt before --allowedTools, which takes every value after it; Agent starts subagents (run.py)
        return [self.binary, "-p", prompt, *(() if first else ("--continue",)), "--model", MODEL, *self.flags,
                "--allowedTools", "Read", "Agent"]


class Opencode(Client):
    def read_tool(self, work: Path) -> ScriptedCall:
        return ScriptedCall("read", {"filePath": str(work / "notes.txt")})

    def configure(self, root: Path, base_url: str, context: int) -> dict[str, str]:
        env = _base_env(root)
        config = {
            "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
            "model": f"kvfork/{MODEL}", "small_model": f"kvfork/{MODEL}",
            "provider": {"kvfork": {"npm": "@ai-sdk/openai-compatible", "name": "kvfork",
                                    "options": {"baseURL": f"{base_url}/v1", "apiKey": KEY,
                                                "timeout": 3600000},  # a CPU prefill outlasts 5 minutes
                                    "models": {MODEL: {"name": MODEL, "limit": {"context": context,
                                                                                "output": min(4096, context // 8)}}}}},
        }
        if context < 16384:
            # opencode's own prompt fills most of a small context: past its threshold it compacts after
            # every reply and continues, turn after turn, as a user of a small model would turn off.
            config["compaction"] = {"auto": False}
        path = root / "opencode.json"
        path.write_text(json.dumps(config, indent=2))
        return env | {"OPENCODE_CONFIG": str(path), "OPENCODE_DISABLE_AUTOUPDATE": "1",
                      "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                      "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_SHARE": "1"}

    def command(self, prompt: str, first: bool, work: Path) -> list[str]:
        return [self.binary, "run", *(() if first else ("--continue",)), "--model", f"kvfork/{MODEL}", prompt]


# Pinned: what `--install` brings and docs/agents.md reports.
CLIENTS = {
    "codex": Codex("codex", "@openai/codex", "0.171.0", "codex", "responses"),
    "claude": ClaudeCode("claude", "@anthropic-ai/claude-code", "2.1.332", "claude", "messages"),
    "opencode": Opencode("opencode", "opencode-ai", "1.18.33", "opencode", "chat"),
}
