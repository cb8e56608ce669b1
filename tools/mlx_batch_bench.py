"""The MLX design measurements behind backends/mlx, side by side in one run:

1. decode of N sessions: merging every session's cache into a batch on each
   step (and extracting it back) against the persistent batch rows join/leave;
2. a clone copied tightly against one copied with room, each followed by its
   first write (a one-token prefill);
3. speculation's decode step of N sessions, `--drafted` of them carrying `--draft` tokens
   and keeping `--accepted` (the rest rolled back: Backend.truncate): the drafted rows
   verified in the decode pass (`shared`: one verify call of every row) against the plain
   rows' decode pass followed by the drafted rows' verify pass (`separate`). Per step, its
   milliseconds and the tokens it commits per second.

    python -m kvfork.tools.mlx_batch_bench --model FOLDER
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvfork.backends.mlx import kvcopy
from kvfork.backends.mlx.backend import MLXBackend
from kvfork.tools.backend_bench import best, prompt, timed


def merge_every_step(b: MLXBackend, sessions, tokens) -> None:
    """One decode step the simple way: merge, run, extract every row back."""
    layers = len(sessions[0].caches)
    merged = [type(sessions[0].caches[l]).merge([s.caches[l] for s in sessions]) for l in range(layers)]
    logits = b.model(mx.array(tokens)[:, None], cache=merged)
    for i, s in enumerate(sessions):
        s.caches = [c.extract(i) for c in merged]
    mx.eval(logits, [kvcopy.arrays(c) for s in sessions for c in s.caches])
    for s in sessions:
        s.position += 1


def bench_decode(b: MLXBackend, n: int, context: int, steps: int, repeat: int) -> dict:
    sessions = [b.open_session() for _ in range(n)]
    for i, s in enumerate(sessions):
        b.prefill([s], [prompt(context + 8 * i, b.info.vocab_size, seed=i)])
    tokens = [101 + i for i in range(n)]
    merged_s = best(lambda: [merge_every_step(b, sessions, tokens) for _ in range(steps)], repeat)
    persistent_s = best(lambda: [b.to_numpy(b.decode(sessions, tokens)) for _ in range(steps)], repeat)
    for s in sessions:
        b.release(s)
    return {
        "sessions": n,
        "context": context,
        "merge_every_step_ms": round(merged_s / steps * 1e3, 2),
        "persistent_batch_ms": round(persistent_s / steps * 1e3, 2),
        "merge_over_persistent": round(merged_s / persistent_s, 2),
    }


def tight_clone(b: MLXBackend, donor, upto: int) -> list[KVCache]:
    caches = []
    for c in donor.caches:
        v, cache = kvcopy.view(c), KVCache()
        # As mlx-lm's BatchKVCache.extract copies: exactly `upto` slots.
        cache.keys = mx.contiguous(v.keys[..., :upto, :])
        cache.values = mx.contiguous(v.values[..., :upto, :])
        cache.offset = upto
        caches.append(cache)
    mx.eval([kvcopy.arrays(c) for c in caches])
    return caches


def bench_clone_room(b: MLXBackend, upto: int, repeat: int) -> dict:
    """Clone cost plus the first write, for a tight copy and one with room (full-attention models)."""
    tokens = prompt(upto + 1, b.info.vocab_size)
    donor = b.open_session()
    b.prefill([donor], [tokens[:upto]])
    out = {"clone_tokens": upto}
    made = [donor]

    def room():
        made.append(b.clone(donor, upto))
        return made[-1].caches

    for name, make in (("tight", lambda: tight_clone(b, donor, upto)), ("room", room)):
        copies = []
        clone_s = best(lambda: copies.append(make()), repeat)
        write = [timed(lambda c=c: mx.eval(b.model(mx.array([tokens[upto:]]), cache=c))) for c in copies]
        out[f"{name}_clone_ms"] = round(clone_s * 1e3, 2)
        out[f"{name}_first_write_ms"] = round(min(write) * 1e3, 2)
    for s in made:
        b.release(s)
    return out


def bench_verify(b: MLXBackend, n: int, context: int, drafted: int, draft: int, accepted: int, steps: int,
                 repeat: int) -> dict:
    out: dict = {"sessions": n, "context": context, "drafted_rows": drafted, "draft": draft, "accepted": accepted}
    committed = n - drafted + drafted * (1 + accepted)
    for mode in ("separate", "shared"):
        sessions = [b.open_session() for _ in range(n)]
        for i, s in enumerate(sessions):
            b.prefill([s], [prompt(context + 8 * i, b.info.vocab_size, seed=i)])
        plain, rows = sessions[:n - drafted], sessions[n - drafted:]
        chunks = [[101 + i, *range(200, 200 + draft)] for i in range(drafted)]

        def step():
            if mode == "shared":
                b.to_numpy(b.verify(sessions, [[7]] * len(plain) + chunks, [1] * len(plain) + [draft + 1] * drafted))
            else:
                if plain:
                    b.to_numpy(b.decode(plain, [7] * len(plain)))
                b.to_numpy(b.verify(rows, chunks, [draft + 1] * drafted))
            for s in rows:
                b.truncate(s, s.position - draft + accepted)

        seconds = best(lambda: [step() for _ in range(steps)], repeat) / steps
        out[f"{mode}_step_ms"] = round(seconds * 1e3, 2)
        out[f"{mode}_tokens_per_s"] = round(committed / seconds, 1)
        for s in sessions:
            b.release(s)
    out["shared_over_separate"] = round(out["shared_tokens_per_s"] / out["separate_tokens_per_s"], 2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--clone", type=int, default=2047)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--drafted", type=int, default=2, help="speculation: rows drafting (of --sessions)")
    parser.add_argument("--draft", type=int, default=8, help="speculation: tokens a drafted row carries")
    parser.add_argument("--accepted", type=int, default=4, help="speculation: drafted tokens a row keeps")
    args = parser.parse_args(argv)
    b = MLXBackend()
    b.load(args.model)
    report = {"model": args.model, "dtype": b.info.dtype, "device": b.info.device, "decode": []}
    for context in [int(c) for c in args.contexts.split(",") if c]:
        report["decode"].append(bench_decode(b, args.sessions, context, args.steps, args.repeat))
    if all(layer.kind == "full" for layer in b.info.layers):
        report["clone_room"] = bench_clone_room(b, args.clone, args.repeat)
    if b.rolls_back:
        report["verify"] = [bench_verify(b, args.sessions, int(c), args.drafted, args.draft, args.accepted,
                                         args.steps, args.repeat) for c in args.contexts.split(",") if c]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
