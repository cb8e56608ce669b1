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
import random
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvfork.backends.base import KV_CACHE_DTYPES, KV_CACHE_SPELLINGS, KVStorageRefused
from kvfork.backends.default_model import ensure_default_model
from kvfork.backends.home import kvfork_home
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.launch.serve import Daemon, pick_backend
from kvfork.tools.bench.text import words
from kvfork.tools.clients.clients import CLIENTS, MODEL, Client
from kvfork.tools.clients.model import write_tiny_long_model
from kvfork.tools.clients.proxy import TURN, Proxy, ScriptedCall, Subagents

PROMPTS = (
    f"{TURN}1 Read the file notes.txt in this folder and tell me what it says.",
    f"{TURN}2 Thanks. Say it again in one word.",
    f"{TURN}3 That is all for now.",
)
NOTES = "kvfork clients: a harmless file the scripted session reads.\n"
# The subagent step: Claude Code starts two subagents, one after the other, each with its own first prompt
SUBAGENTS = Subagents(4, ("List the files in this folder and say what each one holds.",
                          "Find what notes.txt asks for and report it in one line."))
SUBAGENTS_PROMPT = f"{TURN}4 Start two subagents with the Agent tool, one after the other, and report what they found."
# Claude Code's flag that moves the folder, memory path and git status out of the system prompt
EXCLUDE_DYNAMIC = "--exclude-dynamic-system-prompt-sections"


@dataclass
class ClientResult:
    client: str
    version: str
    turns: int = 0
    tool_calls: int = 0
    cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    requests: int = 0
    asked: int = 0  # turns the session was asked to complete
    noted: list[tuple[str, int, int]] = field(default_factory=list)  # requests of note: (which, prompt, cached)


def clients_dir() -> Path:
    return kvfork_home() / "clients"


LOCKFILE = Path(__file__).with_name("package-lock.json")  # beside package.json: the clients and their whole trees


def scripted(names: list[str]) -> list[str]:
    """The packages among the named clients' that have an install step of their own (the lockfile says which)."""
    packages = json.loads(LOCKFILE.read_text())["packages"]
    return [CLIENTS[n].package for n in names if packages[f"node_modules/{CLIENTS[n].package}"].get("hasInstallScript")]


def install(names: list[str]) -> None:
    """The pinned clients into $KVFORK_HOME/clients, every package as kvfork's lockfile pins it (`npm ci`), with
    no install script of any dependency run; then the named clients' own install steps alone (Claude Code's and
    opencode's link the platform's native binary, which npm brought as an optional package; Codex has none),
    which package.json's allowScripts approves (npm 11 runs no other; the lockfile fixes their versions)."""
    folder = clients_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for shipped in (LOCKFILE.with_name("package.json"), LOCKFILE):
        shutil.copyfile(shipped, folder / shipped.name)
    print(f"kvfork clients: npm ci --ignore-scripts into {folder} (package-lock.json: "
          f"{', '.join(f'{c.package}@{c.version}' for c in CLIENTS.values())})", flush=True)
    subprocess.run(["npm", "ci", "--ignore-scripts", "--prefix", str(folder), "--no-audit", "--no-fund"], check=True)
    if own := scripted(names):
        subprocess.run(["npm", "rebuild", "--prefix", str(folder), *own], check=True)


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


def project(root: Path, memory_bytes: int = 0) -> Path:
    """A work folder holding notes.txt and, with `memory_bytes`, a CLAUDE.md that large (a project's memory:
    Claude Code puts it in every session's first request)."""
    work = root / "work"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text(NOTES)
    if memory_bytes:
        rng, lines = random.Random(35), ["# Project notes", ""]
        while sum(len(line) + 1 for line in lines) < memory_bytes:
            lines.append(f"- {words(rng, 14)}.")
        (work / "CLAUDE.md").write_text("\n".join(lines) + "\n")
    return work


async def run_client(client: Client, kvfork_url: str, context: int, turns: int, record: Path | None,
                     timeout_s: float, work: Path | None = None, label: str | None = None,
                     root: Path | None = None, prompts: tuple[str, ...] = PROMPTS,
                     subagents: Subagents | None = None, note_first: bool = False,
                     read: ScriptedCall | None = None) -> ClientResult:
    """One session of `client` (`label` in the table) in `work` (default: a project of its own), its user's
    home and configuration under `root` (default: a folder of its own): `turns` of `prompts`, in which
    the proxy has it start `subagents` (Claude Code); the requests of note (the second table) are the
    subagents' first requests, or with `note_first` the session's first request. `read`: the one read
    the script allows (default: the client's read tool on `work`'s notes.txt)."""
    label = label or client.name
    root = root or Path(tempfile.mkdtemp(prefix=f"kvfork-{client.name}-"))
    work = work or project(root)
    path = binary(client)
    row = ClientResult(label, "not installed", asked=turns)
    if path is None:
        row.errors.append("not installed: run `kvfork clients --install`")
        return row
    proxy = Proxy(kvfork_url, read or client.read_tool(work), record / f"{label}.jsonl" if record else None,
                  subagents)
    base = await proxy.start()
    env = {"PATH": os.environ.get("PATH", "")} | client.configure(root, base, context)
    row.version = version(client, path, env)
    if row.version.startswith("unusable"):
        row.errors.append(f"{path}: {row.version}; reinstall with `kvfork clients --install`")
        await proxy.close()
        return row
    try:
        for turn in range(turns):
            argv = [str(path), *client.command(prompts[turn], turn == 0, work)[1:]]
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
    started = [(prompt, cached) for subagent, prompt, cached in tally.messages if subagent]
    if subagents is not None:
        row.noted = [(f"subagent {i}", prompt, cached) for i, (prompt, cached) in enumerate(started, 1)]
        if len(started) < len(subagents.prompts):
            row.errors.append(f"{len(started)} of {len(subagents.prompts)} subagents started")
    elif note_first and tally.messages:
        row.noted = [("first request", *tally.messages[0][1:])]
    print(f"kvfork clients: {label}: logs in {root}", flush=True)
    return row


def table(rows: list[ClientResult]) -> str:
    lines = ["| client | version | turns | tool calls | cached tokens | requests | errors |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        errors = "; ".join(e.replace("|", "/").replace("\n", " ")[:160] for e in r.errors[:3]) or "none"
        lines.append(f"| {r.client} | {r.version} | {r.turns} | {r.tool_calls} | {r.cached_tokens} | {r.requests} "
                     f"| {errors} |")
    noted = [(r.client, *request) for r in rows for request in r.noted]
    if noted:
        lines += ["", "| session | request | prompt tokens | cached tokens |", "|---|---|---|---|"]
        lines += [f"| {client} | {which} | {prompt} | {cached} |" for client, which, prompt, cached in noted]
    return "\n".join(lines)


async def serve_and_run(args: argparse.Namespace, names: list[str]) -> list[ClientResult]:
    default = ensure_default_model()
    model = str(default if args.model == "default" else
                write_tiny_long_model(kvfork_home() / "models" / "tiny-llama-64k", default)
                if args.model == "tiny" else Path(args.model))
    backend_name, backend = pick_backend(args.backend)
    config = ServerConfig(model=model, backend=backend_name, port=0, served_model_name=[MODEL], accept_any_model=True,
                          log_level="warning")
    # no disk tier: each run starts cold, its cached tokens its own
    daemon = Daemon(config, EngineConfig(prefix_cache_disk_bytes=0, kv_cache_dtype=args.kv_cache_dtype), model, backend)
    await daemon.listen()
    await daemon.load()
    print(f"kvfork clients: serving {model} on {daemon.url} ({backend_name}, KV {args.kv_cache_dtype})", flush=True)
    try:
        context = daemon.engine.config.max_context
        rows = [await run_client(CLIENTS[n], daemon.url, context, args.turns, args.record, args.timeout)
                for n in names]
        if "claude" in names and args.claude_md and args.model != "default":
            rows += await shared_project(daemon.url, context, args)
        if "claude" in names and args.subagents and args.model != "default":
            rows.append(await run_client(CLIENTS["claude"], daemon.url, context, 1, args.record, args.timeout,
                                         label="claude, two subagents", prompts=(SUBAGENTS_PROMPT,),
                                         subagents=SUBAGENTS))
        if "claude" in names and args.projects and args.model != "default":
            rows += await two_projects(daemon.url, context, args)
        return rows
    finally:
        await daemon.close()


async def shared_project(kvfork_url: str, context: int, args: argparse.Namespace) -> list[ClientResult]:
    """Two Claude Code sessions of one user, one after the other, in one project with a large CLAUDE.md:
    the second's first request shares the first's system prompt and tools (its memory path is the user's
    and the project's), which reuse must serve (a long cached prompt once made every later session
    sharing its start fail)."""
    folder = Path(tempfile.mkdtemp(prefix="kvfork-project-"))
    work = project(folder, args.claude_md)
    try:
        return [await run_client(CLIENTS["claude"], kvfork_url, context, 1, args.record, args.timeout, work,
                                 f"claude, session {i} in a project with a {args.claude_md // 1000} KB CLAUDE.md",
                                 folder)
                for i in (1, 2)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def two_projects(kvfork_url: str, context: int, args: argparse.Namespace) -> list[ClientResult]:
    """Claude Code sessions of one user in two projects, one after the other: as it starts by default,
    the project's folder and memory path sit early in the system prompt, before the tools, so the second
    project shares little of the first's first request; with --exclude-dynamic-system-prompt-sections
    those move into the first user message, after the system prompt and tools. Both read one notes.txt
    outside either project: the script's read call, fixed in the tool's schema, is then no difference
    of its own."""
    rows, shared = [], Path(tempfile.mkdtemp(prefix="kvfork-notes-"))
    read = CLIENTS["claude"].read_tool(project(shared))
    try:
        for flags in ((), (EXCLUDE_DYNAMIC,)):
            client = replace(CLIENTS["claude"], flags=flags)
            for name in ("a", "b"):
                folder = Path(tempfile.mkdtemp(prefix=f"kvfork-project-{name}-"))
                try:
                    label = f"claude, project {name}" + (f", {EXCLUDE_DYNAMIC}" if flags else "")
                    rows.append(await run_client(client, kvfork_url, context, 1, args.record, args.timeout,
                                                 project(folder), label, folder, note_first=True, read=read))
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfork clients", description=__doc__)
    parser.add_argument("--install", action="store_true", help="install the pinned clients into "
                        "$KVFORK_HOME/clients first (npm ci --ignore-scripts from kvfork's lockfile, then the "
                        "clients' own install steps)")
    parser.add_argument("--clients", default=",".join(CLIENTS), help="which clients (default: all three)")
    parser.add_argument("--model", default="tiny", help="tiny (a random llama, 64k context), default (SmolLM2, "
                        "8k), or a model folder")
    parser.add_argument("--backend", default="torch", choices=("auto", "mlx", "torch"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES + tuple(KV_CACHE_SPELLINGS),
                        help="how the daemon stores KV state (serve's --kv-cache-dtype, in groups of 64; the tiny "
                        "model's head of 64 takes every one)")
    parser.add_argument("--turns", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1))
    parser.add_argument("--record", type=Path, default=None, help="write each client's requests to DIR/CLIENT.jsonl")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one turn may take")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--claude-md", type=int, default=35_000, help="then two Claude Code sessions in one "
                        "project whose CLAUDE.md is this many bytes (0: none)")
    parser.add_argument("--no-subagents", dest="subagents", action="store_false", help="skip the step where "
                        "Claude Code starts two subagents with different first prompts (the table shows what "
                        "each one's first request reused)")
    parser.add_argument("--no-projects", dest="projects", action="store_false", help="skip the step where Claude "
                        "Code runs in two projects, one after the other, by default and with "
                        f"{EXCLUDE_DYNAMIC} (the table shows what each session's first request reused)")
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
    try:
        rows = asyncio.run(serve_and_run(args, names))
    except KVStorageRefused as e:  # a --kv-cache-dtype the model or backend cannot take
        print(f"kvfork clients: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    # on the default model (8k) Claude Code's prompt does not fit, and the others complete one turn
    expected = [min(r.asked, 1) if args.model == "default" else r.asked for r in rows]
    return 0 if all(r.turns >= e or (args.model == "default" and r.client == "claude")
                    for r, e in zip(rows, expected)) else 1
