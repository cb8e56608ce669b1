"""Install, serve, run each client's scripted session, print the table (see __init__.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvfork.server.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.serve import Daemon, pick_backend
from kvfork.tools.clients.clients import CLIENTS, MODEL, Client
from kvfork.tools.clients.model import write_tiny_long_model
from kvfork.tools.clients.proxy import TURN, Proxy
from kvfork.backends.default_model import ensure_default_model
from kvfork.backends.model_path import kvfork_home

PROMPTS = (
    f"{TURN}1 Read the file notes.txt in this folder and tell me what it says.",
    f"{TURN}2 Thanks. Say it again in one word.",
    f"{TURN}3 That is all for now.",
)
NOTES = "kvfork clients: a harmless file the scripted session reads.\n"


@dataclass
class Row:
    client: str
    version: str
    turns: int = 0
    tool_calls: int = 0
    cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    requests: int = 0


def clients_dir() -> Path:
    return kvfork_home() / "clients"


def install(names: list[str]) -> None:
    """npm install the pinned clients into $KVFORK_HOME/clients (their install scripts link the
    platform's native binary, which npm brings as an optional package)."""
    folder = clients_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # npm 11 runs a package's install script only when package.json allows it: approve the clients'.
    manifest = folder / "package.json"
    data = json.loads(manifest.read_text()) if manifest.exists() else {}
    data.setdefault("allowScripts", {}).update({CLIENTS[n].package: True for n in names})
    manifest.write_text(json.dumps(data, indent=2) + "\n")
    specs = [f"{CLIENTS[n].package}@{CLIENTS[n].version}" for n in names]
    print(f"kvfork clients: npm install {' '.join(specs)} into {folder}", flush=True)
    subprocess.run(["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund", *specs], check=True)
    # a package installed earlier without its script gets it run now
    subprocess.run(["npm", "rebuild", "--prefix", str(folder), *(CLIENTS[n].package for n in names)], check=True)


def binary(client: Client) -> Path | None:
    path = clients_dir() / "node_modules" / ".bin" / client.binary
    return path if path.exists() else None


def version(client: Client, path: Path, env: dict[str, str]) -> str:
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, env=env, timeout=120)
    except OSError as e:
        return f"unusable ({e.strerror})"
    words = [w for w in out.stdout.split() if w[:1].isdigit()]
    return words[0] if words else "?"


async def run_client(client: Client, kvfork_url: str, context: int, turns: int, record: Path | None,
                     timeout_s: float) -> Row:
    root = Path(tempfile.mkdtemp(prefix=f"kvfork-{client.name}-"))
    work = root / "work"
    work.mkdir()
    (work / "notes.txt").write_text(NOTES)
    path = binary(client)
    row = Row(client.name, "not installed")
    if path is None:
        row.errors.append("not installed: run `kvfork clients --install`")
        return row
    proxy = Proxy(kvfork_url, client.read_tool(work), record / f"{client.name}.jsonl" if record else None)
    base = await proxy.start()
    env = {"PATH": os.environ.get("PATH", "")} | client.configure(root, base, context)
    row.version = version(client, path, env)
    if row.version.startswith("unusable"):
        row.errors.append(f"{path}: {row.version}; reinstall with `kvfork clients --install`")
        await proxy.close()
        return row
    try:
        for turn in range(turns):
            argv = [str(path), *client.command(PROMPTS[turn], turn == 0, work)[1:]]
            process = await asyncio.create_subprocess_exec(*argv, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
            except TimeoutError:
                process.kill()
                await process.wait()
                row.errors.append(f"turn {turn + 1}: no answer in {timeout_s:g} s")
                break
            (root / f"turn{turn + 1}.log").write_bytes(output)
            if process.returncode != 0:
                tail = output.decode(errors="replace").strip().splitlines()[-3:]
                row.errors.append(f"turn {turn + 1}: exit {process.returncode}: {' | '.join(tail)}")
                break
            row.turns += 1
    finally:
        await proxy.close()
    tally = proxy.tally
    row.tool_calls, row.cached_tokens, row.requests = tally.tool_calls, tally.cached_tokens, tally.requests
    row.errors += tally.errors
    print(f"kvfork clients: {client.name}: logs in {root}", flush=True)
    return row


def table(rows: list[Row]) -> str:
    lines = ["| client | version | turns | tool calls | cached tokens | requests | errors |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        errors = "; ".join(e.replace("|", "/").replace("\n", " ")[:160] for e in r.errors[:3]) or "none"
        lines.append(f"| {r.client} | {r.version} | {r.turns} | {r.tool_calls} | {r.cached_tokens} | {r.requests} "
                     f"| {errors} |")
    return "\n".join(lines)


async def serve_and_run(args: argparse.Namespace, names: list[str]) -> list[Row]:
    default = ensure_default_model()
    model = str(default if args.model == "default" else
                write_tiny_long_model(kvfork_home() / "models" / "tiny-llama-64k", default)
                if args.model == "tiny" else Path(args.model))
    backend_name, backend = pick_backend(args.backend)
    config = ServerConfig(model=model, backend=backend_name, port=0, served_model_name=[MODEL], accept_any_model=True,
                          log_level="warning")
    # no disk tier: each run starts cold, its cached tokens its own
    daemon = Daemon(config, EngineConfig(prefix_cache_disk_bytes=0), model, backend)
    await daemon.listen()
    await daemon.load()
    print(f"kvfork clients: serving {model} on {daemon.url} ({backend_name})", flush=True)
    try:
        context = daemon.engine.config.max_context
        return [await run_client(CLIENTS[n], daemon.url, context, args.turns, args.record, args.timeout)
                for n in names]
    finally:
        await daemon.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfork clients", description=__doc__)
    parser.add_argument("--install", action="store_true", help="npm install the pinned clients into "
                        "$KVFORK_HOME/clients first")
    parser.add_argument("--clients", default=",".join(CLIENTS), help="which clients (default: all three)")
    parser.add_argument("--model", default="tiny", help="tiny (a random llama, 64k context), default (SmolLM2, "
                        "8k), or a model folder")
    parser.add_argument("--backend", default="torch", choices=("auto", "mlx", "torch"))
    parser.add_argument("--turns", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1))
    parser.add_argument("--record", type=Path, default=None, help="write each client's requests to DIR/CLIENT.jsonl")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one turn may take")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.clients.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        parser.error(f"unknown client {unknown[0]!r} (clients: {', '.join(CLIENTS)})")
    if args.install:
        if shutil.which("npm") is None:
            print("kvfork clients: npm is not installed", file=sys.stderr)
            return 2
        install(names)
    if args.record:
        args.record.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING)
    rows = asyncio.run(serve_and_run(args, names))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    expected = args.turns if args.model != "default" else 1
    return 0 if all(r.turns >= expected or (args.model == "default" and r.client == "claude") for r in rows) else 1
