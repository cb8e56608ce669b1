"""Several models in one daemon: the TTFT of each return to model A in an agent conversation that alternates
A -> B -> A, against (i) a daemon where A is never unloaded and (ii) a restart of A's server per switch (what
llama-swap does: a fresh server, its cache lost).

    python -m kvfork.tools.models_bench [--model FOLDER] [--backend torch] [--switches 3] [--tokens 2000]

A: the default model (or --model); B: random weights at A's sizes (B's folder written to a temporary folder,
A's config and tokenizer). Each conversation opens with a system prompt of about --tokens tokens and adds a
user turn and the answer per call. Three runs, on a temporary KVFORK_HOME (the first two in this process):
  switch   one model loaded at a time (--max-loaded-models 1): every call to A follows a call to B, so A
           unloaded (its prefix cache spilled to disk) and loads again, restoring from its files;
  resident A alone, never unloaded (i): B's calls, in a daemon holding both, would not touch A's cache;
  restart  each return to A starts a fresh `kvfork serve` process of A alone with an empty cache and sends it
           the switch run's request, timed from the process's start (ii).
TTFT: from sending the request (the restart: from starting the process) to the first streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from kvfork.backends import create_backend
from kvfork.backends.default_model import default_model_dir
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.launch.pool_daemon import PoolDaemon
from kvfork.server.launch.model_source import model_source
from kvfork.server.pool.specs import model_specs
from kvfork.tools.bench.serve import ServerProcess

WORDS = ("the build failed on the parser module because a test expects trailing commas in every list literal "
         "and the formatter removed them while the linter asked for them back").split()


def random_twin(model: Path, folder: Path) -> Path:
    """A model of `model`'s config and tokenizer with random weights of the same shapes and dtypes."""
    from safetensors.numpy import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, folder / f.name)
    rng = np.random.default_rng(1)
    for f in model.glob("*.safetensors"):
        tensors = {k: (rng.standard_normal(v.shape) * 0.02).astype(v.dtype) for k, v in load_file(f).items()}
        save_file(tensors, str(folder / f.name), metadata={"format": "pt"})
    return folder


def system_prompt(tokens: int) -> str:
    words = [WORDS[i % len(WORDS)] for i in range(int(tokens * 0.75))]
    return "You are a coding agent. Notes from the session so far: " + " ".join(words)


async def ttft(http: aiohttp.ClientSession, url: str, model: str, messages: list, max_tokens: int) -> tuple[float, str]:
    """Seconds to the first streamed token, and the whole answer."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0, first, text = time.perf_counter(), None, []
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter() - t0
                text.append(delta)
    return first or time.perf_counter() - t0, "".join(text)


class Conversation:
    def __init__(self, system: str):
        self.messages = [{"role": "system", "content": system}]
        self.turn = 0

    def ask(self) -> list:
        self.turn += 1
        self.messages.append({"role": "user", "content": f"Step {self.turn}: run the tests again and say what broke."})
        return self.messages

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


async def pooled(models: dict[str, str], loaded: int, args) -> tuple[list[float], list[list]]:
    """TTFTs of the returns to A in a daemon holding `loaded` models at once, and the messages of each."""
    config = ServerConfig(model=[f"{n}={p}" for n, p in models.items()], port=0, max_loaded_models=loaded,
                          backend=args.backend, shutdown_grace=1.0)
    engine = EngineConfig(kv_budget_bytes=args.kv_budget or None, inference_slots=2)
    daemon = PoolDaemon(config, engine, model_specs(config.model, None, model_source), args.backend,
                        lambda: create_backend(args.backend))
    talks = {name: Conversation(system_prompt(args.tokens)) for name in models}
    returns, asked = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        await daemon.listen()
        try:
            await daemon.load()
            calls = [name for name in ["A"] + ["B", "A"] * args.switches if name in models]
            for call, name in enumerate(calls):
                messages = talks[name].ask()
                seconds, text = await ttft(http, daemon.url, name, messages, args.max_tokens)
                talks[name].answered(text)
                if name == "A" and call:
                    returns.append(seconds)
                    asked.append(list(messages))
        finally:
            await daemon.close()
    return returns, asked


async def restart(model: str, messages: list, args, folder: Path) -> float:
    """From starting a fresh `kvfork serve` process of A alone, on an empty KVFORK_HOME, to the first token
    of `messages`: the process's imports, the load and the whole prefill (its readiness polled each 0.5 s)."""
    home = Path(tempfile.mkdtemp(prefix="kvfork-restart-"))
    budget = ["--kv-budget-bytes", str(args.kv_budget)] if args.kv_budget else []
    server = ServerProcess("kvfork", [sys.executable, "-m", "kvfork", "serve", "--model", model, "--port", "{port}",
                                      "--backend", args.backend, "--served-model-name", "A", *budget,
                                      "--inference-slots", "2"],
                           folder / "restart.log", env={"KVFORK_HOME": str(home)}, scratch=home)
    t0 = time.perf_counter()
    with server:
        started = time.perf_counter() - t0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            seconds, _ = await ttft(http, server.base_url, "A", messages, args.max_tokens)
    return started + seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfork.tools.models_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(default_model_dir()), help="model A (default: the default model)")
    p.add_argument("--backend", default="torch")
    p.add_argument("--switches", type=int, default=3, help="returns to A (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=2000, help="the conversation's system prompt, about")
    p.add_argument("--max-tokens", type=int, default=32, help="each answer's tokens")
    p.add_argument("--kv-budget", type=int, default=1 << 30,
                   help="each model's KV budget, bytes (0: the daemon's default, a share of the memory budget)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvfork-models-bench-") as folder:
        models = {"A": args.model, "B": str(random_twin(Path(args.model), Path(folder) / "B"))}
        os.environ["KVFORK_HOME"] = str(Path(folder) / "switch")
        switch, asked = asyncio.run(pooled(models, 1, args))
        os.environ["KVFORK_HOME"] = str(Path(folder) / "resident")  # a cold disk tier, as the switch run's was
        resident, _ = asyncio.run(pooled({"A": args.model}, 1, args))  # B's calls would not touch A
        restarts = [asyncio.run(restart(args.model, messages, args, Path(folder))) for messages in asked]
    print("| return to A | switch (A unloaded, restored from disk) | (i) A never unloaded | (ii) restart per "
          "switch | switch / restart |")
    print("|---|---|---|---|---|")
    for i, (s, r, x) in enumerate(zip(switch, resident, restarts), 1):
        print(f"| {i} | {s:.2f} s | {r:.2f} s | {x:.2f} s | {s / x:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
