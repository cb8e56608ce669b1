"""Where a model's return goes, in one process: a fresh load against a load again from the folder (what main
does on a return: the read and the reorder, the warm-up skipped) and a load from what an unload kept
(`Backend.reuse`), each on a thread of its own as the engine's runner loads, then the first prefill on that
thread and a second one.

    python -m kvfork.tools.reload_probe [--model FOLDER] [--tokens 31] [--rounds 2]

Each line: the way the model came, the load's seconds, the first and the second prefill of --tokens tokens
(fresh random prompts of one length, logits on the host).
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from kvfork.backends import create_backend
from kvfork.backends.default_model import default_model_dir


def on_thread(fn):
    """`fn()` on a new thread, as the engine's runner thread runs a model's load and passes."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def served(backend, folder: str, tokens: int, seed: int) -> tuple[tuple[float, float], ...]:
    """Load `backend` and run two prefills, all on one new thread: the wall and CPU seconds of each."""
    rng = np.random.default_rng(seed)

    def prefill() -> tuple[float, float]:
        s = backend.open_session()
        t0, c0 = time.perf_counter(), time.process_time()
        backend.to_numpy(backend.prefill([s], [rng.integers(100, 30000, tokens).tolist()]))
        backend.release(s)
        return time.perf_counter() - t0, time.process_time() - c0

    def run() -> tuple[tuple[float, float], ...]:
        t0, c0 = time.perf_counter(), time.process_time()
        backend.load(folder)
        return (time.perf_counter() - t0, time.process_time() - c0), prefill(), prefill()

    return on_thread(run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfork.tools.reload_probe", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--tokens", type=int, default=31, help="each prefill's prompt")
    p.add_argument("--rounds", type=int, default=2, help="returns of each kind")
    args = p.parse_args(argv)
    first = create_backend("torch")
    rows = [("fresh", *served(first, args.model, args.tokens, 0))]
    built = first.built()
    for i in range(args.rounds):
        rows.append(("again from the folder", *served(create_backend("torch"), args.model, args.tokens, i + 1)))
        kept = create_backend("torch")
        kept.reuse(built)
        rows.append(("from what was kept", *served(kept, args.model, args.tokens, i + 1)))
    print("wall seconds / CPU seconds (all threads)\n| load | load | first prefill | second prefill |\n|---|---|---|---|")
    for name, *parts in rows:
        print(f"| {name} | " + " | ".join(f"{wall:.3f} / {cpu:.3f} s" for wall, cpu in parts) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
