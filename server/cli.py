"""`kvfork`: serve, fetch-model, bench, smoke, soak.

Every serve flag comes from a config dataclass (ServerConfig here, EngineConfig
in the engine), so a flag's default, check and help live in one place. A bad
value exits with code 2 and one line saying why, before anything loads.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from pathlib import Path
from typing import NoReturn

from kvfork.backends import prepare_process
from kvfork.backends.model_path import resolve_model
from kvfork.server.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.settings import add_arguments, from_args
from kvfork.server.tenants import key_tenants
from kvfork.server.warm import read_warm_file

# Commands are imported only when asked for: each pulls its own dependencies. bench, smoke and soak are
# tools (entry points that import the product, never the reverse): a checkout without tools/ lacks them.
COMMANDS = {
    "fetch-model": ("kvfork.backends.default_model", "fetch the default model (SmolLM2) and convert it"),
    "bench": ("kvfork.tools.bench", "replay benchmark against a running daemon"),
    "smoke": ("kvfork.tools.smoke", "end-to-end check of active prefix reuse on the default model"),
    "soak": ("kvfork.tools.soak", "load, faults, hang-ups and bad input against an in-process daemon; one table of checks"),
    "cache": ("kvfork.server.cache_command", "show (ls) or empty (clear) the prefix cache's disk tier"),
    "cluster": ("kvfork.tools.cluster", "N replicas of one model on this machine behind smg (pip install 'kvfork[cluster]')"),
    "clients": ("kvfork.tools.clients", "Codex CLI, Claude Code and opencode, unchanged, in scripted sessions; one table"),
}
USAGE = ("usage: kvfork {serve,fetch-model,bench,smoke,soak,cache,cluster,clients} [options]   "
         "(kvfork COMMAND --help for a command's options)")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def serve_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvfork serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    add_arguments(parser, ServerConfig)
    add_arguments(parser, EngineConfig)
    return parser


def serve(argv: list[str]) -> int:
    parser = serve_parser()
    args = parser.parse_args(argv)
    try:
        config = from_args(ServerConfig, args)
        engine_config = from_args(EngineConfig, args)
        key_tenants(config.api_key, config.api_keys_file)  # the keys agree with each other
    except ValueError as e:
        parser.error(str(e))
    if config.prefix_cache_warm:
        try:
            read_warm_file(config.prefix_cache_warm)
        except ValueError as e:
            parser.error(f"--prefix-cache-warm: {e}")
    prepare_process(config.backend)
    try:
        model = str(resolve_model(config.model)) if config.model else str(_default_model())
    except FileNotFoundError as e:
        parser.error(f"--model: {e}")
    if not (Path(model) / "config.json").is_file():
        parser.error(f"--model: {model} is not a model folder (it has no config.json)")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.distributed:
        from kvfork.server.distributed import serve as serve_ranks

        return serve_ranks(config, engine_config, model)
    from kvfork.server.serve import run  # the engine and backends load only for a valid command line

    try:
        return asyncio.run(run(config, engine_config, model))
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130


def _default_model() -> Path:
    from kvfork.backends.default_model import FetchError, ensure_default_model

    try:
        return ensure_default_model()
    except FetchError as e:
        sys.exit(f"kvfork: the default model is not available: {e} (or pass --model FOLDER)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        lines = [USAGE, "  serve        run the daemon (default model unless --model)"]
        lines += [f"  {name:<12} {help_text}" for name, (_, help_text) in COMMANDS.items()]
        print("\n".join(lines))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command in COMMANDS:
        module = COMMANDS[command][0]
        try:
            tool = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            print(f"kvfork: error: {command} is not part of this checkout ({module} is missing)", file=sys.stderr)
            return 1
        return tool.main(rest) or 0
    print(f"kvfork: error: unknown command {command!r} (commands: serve, {', '.join(COMMANDS)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
