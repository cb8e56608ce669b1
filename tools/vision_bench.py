"""An agent's screenshot, replayed: TTFT of the turn that reads a 1280x800 screenshot in a tool result, then of
the next turn that carries it again, on a daemon with reuse and on one without, side by side in one run.

    python -m kvfork.tools.vision_bench [--model FOLDER] [--backend torch] [--screens 3]

The model is a random-weight SmolVLM at SmolVLM-256M's shapes (`kvfork.tools.vision_model --size 256m`,
written to a temporary folder unless --model names one): its tower splits a 1280x800 screenshot into 12 tiles
and the whole (13 x 64 image tokens). Each screen is a new screenshot (so the first turn encodes it); a turn
is timed from its request to its one token (max_tokens 1), and each daemon first answers a text turn. The
daemon without reuse has its prefix cache, disk tier and active reuse off; its encoder cache is on (it keeps
the image's encoding, not a prompt's state), so its second turn shows what the prompt's reuse adds beyond not
encoding again, and its first turn what every turn costs with nothing kept. Each daemon runs on a fresh
temporary KVFORK_HOME, so no turn starts from an earlier run's disk tier.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from kvfork.backends import create_backend
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.launch.serve import Daemon

SYSTEM = ("You are a computer-use agent. You see the user's screen through the screenshot tool and act on it "
          "with clicks and keystrokes; say what you see before you act. ") * 8
REUSE_OFF = dict(prefix_cache_entries=0, prefix_cache_disk_bytes=0, active_prefix_reuse_min_tokens=0)
WIDTH, HEIGHT = 1280, 800


def screenshot(seed: int) -> str:
    """A screen-like PNG: a desktop, windows of flat colours, a block of noise (text) in each."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = np.full((HEIGHT, WIDTH, 3), 235, dtype=np.uint8)
    for _ in range(4):
        x, y = int(rng.integers(0, WIDTH - 400)), int(rng.integers(0, HEIGHT - 300))
        pixels[y:y + 300, x:x + 400] = rng.integers(0, 256, 3)
        pixels[y + 40:y + 120, x + 20:x + 380] = rng.integers(0, 256, (80, 360, 3))
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def turns(png: str) -> tuple[list[dict], list[dict]]:
    """The turn whose tool result is the screenshot, and the next turn carrying it (Messages' shape)."""
    first = [{"role": "user", "content": "Open the settings and turn on dark mode."},
             {"role": "assistant", "content": [{"type": "text", "text": "I will look at the screen first."},
                                               {"type": "tool_use", "id": "toolu_1", "name": "screenshot",
                                                "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}]}]
    second = first + [{"role": "assistant", "content": [
        {"type": "text", "text": "The settings window is open at the top left."},
        {"type": "tool_use", "id": "toolu_2", "name": "click", "input": {"x": 120, "y": 80}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "clicked"}]}]
    return first, second


async def timed(http: aiohttp.ClientSession, url: str, messages: list[dict]) -> dict:
    body = {"model": "vision", "system": SYSTEM, "max_tokens": 1, "temperature": 0, "messages": messages,
            "tools": [{"name": "screenshot", "description": "the screen", "input_schema": {"type": "object"}},
                      {"name": "click", "description": "click at x, y", "input_schema": {"type": "object"}}]}
    t0 = time.perf_counter()
    async with http.post(url + "/v1/messages", json=body) as r:
        reply = await r.json()
        if r.status != 200:
            raise RuntimeError(json.dumps(reply))
    usage = reply["usage"]
    return {"ttft_s": time.perf_counter() - t0, "prompt": usage["input_tokens"] + usage["cache_read_input_tokens"],
            "cached": usage["cache_read_input_tokens"]}


async def one_daemon(model: str, backend: str, engine: dict, screens: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="kvfork-home-") as home:
        previous = os.environ.get("KVFORK_HOME")
        os.environ["KVFORK_HOME"] = home
        try:
            return await served(model, backend, engine, screens)
        finally:
            if previous is None:
                del os.environ["KVFORK_HOME"]
            else:
                os.environ["KVFORK_HOME"] = previous


async def served(model: str, backend: str, engine: dict, screens: list[str]) -> list[dict]:
    config = ServerConfig(model=model, port=0, served_model_name=["vision"], max_body_bytes=64 << 20)
    daemon = Daemon(config, EngineConfig(**engine), model, create_backend(backend))
    out = []
    async with daemon.serving(), aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        await timed(http, daemon.url, [{"role": "user", "content": "Are you there?"}])  # the first pass is slower
        for png in screens:
            first, second = turns(png)
            out.append({"first": await timed(http, daemon.url, first), "second": await timed(http, daemon.url, second)})
        text = await (await http.get(daemon.url + "/metrics")).text()
    encoded = next((float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("kvfork_images_encoded_total")), 0.0)
    out.append({"images_encoded": encoded})
    return out


def median(runs: list[dict], turn: str) -> float:
    return statistics.median(run[turn]["ttft_s"] for run in runs)


async def main_async(args) -> dict:
    model = args.model
    if model is None:
        from kvfork.tools.vision_model import write

        model = str(write(Path(tempfile.mkdtemp(prefix="kvfork-vision-")) / "smolvlm-256m", "256m"))
    screens = [screenshot(seed) for seed in range(args.screens)]
    on = await one_daemon(model, args.backend, {}, screens)
    off = await one_daemon(model, args.backend, REUSE_OFF, screens)
    runs_on, runs_off = on[:-1], off[:-1]
    return {
        "model": Path(model).name, "screens": args.screens, "image": f"{WIDTH}x{HEIGHT}",
        "first_turn_ttft_s": median(runs_on, "first"), "second_turn_ttft_s": median(runs_on, "second"),
        "second_turn_reuse_off_ttft_s": median(runs_off, "second"),
        "second_vs_first": median(runs_on, "first") / median(runs_on, "second"),
        "second_vs_reuse_off": median(runs_off, "second") / median(runs_on, "second"),
        "first_turn_reuse_off_ttft_s": median(runs_off, "first"),
        "prompt_tokens": runs_on[0]["second"]["prompt"], "cached_tokens": runs_on[0]["second"]["cached"],
        "images_encoded": {"reuse": on[-1]["images_encoded"], "reuse_off": off[-1]["images_encoded"]},
        "runs": {"reuse": runs_on, "reuse_off": runs_off},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a vision model folder (default: a random one at "
                        "SmolVLM-256M's shapes, written to a temporary folder)")
    parser.add_argument("--backend", default="torch", choices=["torch"])
    parser.add_argument("--screens", type=int, default=3, help="screenshots replayed, each two turns")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(main_async(args)), indent=2))


if __name__ == "__main__":
    main()
