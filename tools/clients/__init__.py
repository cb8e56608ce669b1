"""`kvfork clients` (`make clients`): the real agent clients, unchanged, against a local kvfork.

Codex CLI (`@openai/codex`, the Responses API), Claude Code (`@anthropic-ai/claude-code`, the
Messages API) and opencode (`opencode-ai`, chat completions) are installed from npm into
$KVFORK_HOME/clients when asked (`--install`), at the versions pinned in clients.py, and each is
configured offline in a throwaway folder of its own: its own home, a base URL, a dummy key, no
telemetry, no update checks, no login. kvfork runs in this process on a tiny random llama with a
64k context (model.py), so Claude Code's ~20k-token first request fits; `--model default` serves
the default model instead (8k context), where Claude Code's prompt does not fit and must get
Anthropic's context-length error.

Each client runs a scripted session of `--turns` turns in a throwaway folder holding notes.txt:
turn 1 asks it to read the file, later turns talk. A random model writes no tool call of its own,
so a scripted proxy (proxy.py) in front of kvfork forces the one harmless call (reading notes.txt
with the client's own read tool, arguments fixed by a grammar) and ends other replies with a short
JSON reply; then Claude Code starts two subagents with different first prompts (its Agent tool, the
calls' arguments fixed the same way), and a second table shows what each subagent's first request
reused. The proxy also records every request the client sends (`--record DIR`: the raw material of the
wire-shape fixtures in tests/fixtures/clients) and counts kvfork's answers. The table: client,
version, turns completed, tool calls, cached tokens, errors. Exits 1 when a client fails a turn it
should complete.
"""

from kvfork.tools.clients.run import main

__all__ = ["main"]
