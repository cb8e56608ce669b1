"""The soak's long-prompt wave: requests leaving a long cached prompt near its start, in its middle and
near its end, as agents' 30-150k-token prompts do (a project's system prompt, tools and history, then
each session's own turn).

One prompt of `--long-prompt-tokens` token ids (24,000 by default) is computed and cached; then three
prompts share its first 40 tokens, its first half, and all but its last 40, each with a tail of its own.
The first leaves the cached prompt ~24k tokens before its end: a lookup that walked the prefix trie by
recursion (one level per 16-token block) raised RecursionError there. Checks:
- every request gets 200, and no lookup fell back (`kvfork_reuse_errors_total` stays 0);
- each reuses what it shares with the long prompt, where that reaches the matching minimum;
- each gives the same tokens as on a daemon with reuse off.

The model is the soak's, on a copy whose context is raised to hold the prompt where it is shorter
(config.json rewritten, every other file linked): a RoPE model runs positions past its trained context
with whatever quality, and the wave checks reuse, not prose.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.launch.serve import Daemon

MIN_TOKENS = 64  # the daemon's default --prefix-cache-min-tokens
TAIL = 24  # tokens each parting adds of its own
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def with_context(model: str, context: int, into: Path) -> str:
    """`model` itself where its context holds `context` tokens; else a copy under `into` whose config.json
    says `context`, every other file linked."""
    folder = Path(model)
    config = json.loads((folder / "config.json").read_text())
    if all(config.get(k, 0) >= context for k in CONTEXT_KEYS if k in config) and any(k in config for k in CONTEXT_KEYS):
        return model
    copy = into / f"{folder.name}-{context}"
    copy.mkdir()
    for item in folder.iterdir():
        if item.name != "config.json":
            (copy / item.name).symlink_to(item.resolve())
    config.update({k: context for k in CONTEXT_KEYS if k in config} or {"max_position_embeddings": context})
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return str(copy)


def partings(long: list[int], rng: random.Random, vocab: int,
             lengths: tuple[int, ...] = ()) -> dict[str, tuple[list[int], int]]:
    """Prompts leaving `long` near its start, in its middle and near its end, and the cached tokens each
    must get (what it shares, where that reaches the minimum). Each of `lengths` adds the middle and the
    end of `long`'s first that many tokens: the partings of a shorter cached prompt, read from one prefill."""
    points = {"start": 40, "middle": len(long) // 2, "end": len(long) - 40}
    for length in lengths:
        points.update({f"middle of {length}": length // 2, f"end of {length}": length - 40})
    out = {}
    for name, shared in points.items():
        tail = [rng.randrange(3, vocab) for _ in range(TAIL)]
        while tail[0] == long[shared]:
            tail[0] = rng.randrange(3, vocab)
        out[name] = (long[:shared] + tail, shared if shared >= MIN_TOKENS else 0)
    return out


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as r:
        reply = await r.json()
        return {"status": r.status, "text": reply["choices"][0]["text"] if r.status == 200 else None,
                "cached": reply["usage"]["prompt_tokens_details"]["cached_tokens"] if r.status == 200 else None}


def _daemon(model: str, backend: Any, reuse: bool) -> Any:
    config = ServerConfig(model=model, port=0, host="127.0.0.1", shutdown_grace=1.0, dtype="float32")
    engine = EngineConfig(prefix_cache_min_tokens=MIN_TOKENS, prefix_cache_disk_bytes=0,
                          prefix_cache_entries=16 if reuse else 0,
                          active_prefix_reuse_min_tokens=64 if reuse else 0)
    return Daemon(config, engine, model, backend).serving()


async def run_long_wave(model: str, backend_name: str, tokens: int, seed: int, out) -> list[tuple[str, str, str, bool]]:
    """(name, measured, wanted, ok) rows for the soak's table."""
    from kvfork.backends import create_backend
    from kvfork.tools.bench.serve import parse_metrics

    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None)
    with tempfile.TemporaryDirectory(prefix="kvfork-long-") as tmp:
        folder = with_context(model, tokens + 2 * TAIL, Path(tmp))
        async with _daemon(folder, create_backend(backend_name), reuse=True) as d, \
                aiohttp.ClientSession(timeout=timeout) as http:
            vocab = d.engine.info.vocab_size
            long = [rng.randrange(3, vocab) for _ in range(tokens)]
            cases = partings(long, rng, vocab)
            print(f"soak: the long-prompt wave: {tokens} tokens, then {len(cases)} prompts leaving it", file=out,
                  flush=True)
            first = await complete(http, d.url, long, 2)
            got = {name: await complete(http, d.url, prompt, 8) for name, (prompt, _) in cases.items()}
            async with http.get(d.url + "/metrics") as r:
                fallbacks = sum(v for k, v in parse_metrics(await r.text()).items()
                                if k.startswith("kvfork_reuse_errors_total"))
        async with _daemon(folder, create_backend(backend_name), reuse=False) as d, \
                aiohttp.ClientSession(timeout=timeout) as http:
            plain = {name: await complete(http, d.url, prompt, 8) for name, (prompt, _) in cases.items()}
    statuses = [first["status"]] + [g["status"] for g in got.values()]
    reused = {name: g["cached"] for name, g in got.items()}
    want = {name: cached for name, (_, cached) in cases.items()}
    same = [name for name in cases if got[name]["text"] is not None and got[name]["text"] == plain[name]["text"]]
    return [
        (f"long prompts ({tokens} tokens, left near start, middle, end): status 200",
         " ".join(map(str, statuses)), "all 200", all(s == 200 for s in statuses)),
        ("long prompts: lookups that fell back to prefill", f"{fallbacks:g}", "0", fallbacks == 0),
        ("long prompts: cached tokens (start, middle, end)", " ".join(str(reused[n]) for n in cases),
         " ".join(str(want[n]) for n in cases), reused == want),
        ("long prompts: equal to a reuse-off daemon", f"{len(same)}/{len(cases)}", "all", len(same) == len(cases)),
    ]
