"""Per-step overhead of one model on 2 ranks against 1 process, on this machine (docs/benchmarks.md).

    python -m kvfork.tools.rank_bench [--backend torch|mlx] [--shape small|0.5b] [--sessions 1,4] [--steps 24]
                               [--device cpu|cuda]

Writes a random-weight llama-shaped model (heads that split over 2), then times decode steps at a
256-token context: in one process, then on 2 ranks under the backend's launcher, one thread per
process (on a shared machine more threads than free cores make OpenMP's barriers spin: a 2-thread
process measured 50x slower here under load). On rank 0 it also times what is not
compute: the broadcast of each step's effects (LockstepBackend.broadcast_seconds), and one collective of a decode
step's activations ([rows, hidden], float32) on the model's group, of which a step runs 2 per layer
(after attention, after the MLP) plus the embedding's and the logits' on torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {
    # ~47M parameters: a decode step of a few ms here, so the fixed costs show.
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    # Qwen2.5-0.5B's shape (14 heads, 2 KV heads).
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, head_dim=64),
}
CONTEXT = 256


def write_model(folder: Path, shape: dict) -> Path:
    """A llama folder of random float32 weights (HF names); a word-level tokenizer over the vocabulary."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    rng = np.random.default_rng(0)
    h, inter, heads, kv, d = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim"))
    weights = {"model.embed_tokens.weight": (shape["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                        p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                        p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                        p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                        p + "post_attention_layernorm.weight": (h,)})
    arrays = {name: (np.ones(s, np.float32) if len(s) == 1 else
                     (rng.standard_normal(s, np.float32) / np.sqrt(s[-1])).astype(np.float32))
              for name, s in weights.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = dict(shape, model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-6,
                  max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=0,
                  torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def decode_steps(backend, sessions: list[int], steps: int, on_step=None) -> dict[int, float]:
    """Median seconds of a decode step of n sessions at CONTEXT tokens, for each n."""
    b = backend
    tokens = [int(t) for t in np.random.default_rng(1).integers(10, 30000, CONTEXT)]
    donor = b.open_session()
    b.to_numpy(b.prefill([donor], [tokens]))
    opened = [donor] + [b.clone(donor, CONTEXT) for _ in range(max(sessions) - 1)]
    out = {}
    for n in sessions:
        batch, ids = opened[:n], [101 + i for i in range(n)]
        b.to_numpy(b.decode(batch, ids))  # warm-up
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            b.to_numpy(b.decode(batch, ids))
            times.append(time.perf_counter() - start)
            if on_step:
                on_step(n)
        out[n] = statistics.median(times)
    for s in opened:
        b.release(s)
    return out


def one_process(name: str, folder: Path, sessions: list[int], steps: int) -> dict:
    from kvfork.backends import create_backend

    b = create_backend(name)
    b.load(str(folder), "float32")
    return {"step_s": decode_steps(b, sessions, steps)}


def collective_seconds(ranks, hidden: int, rows: int, repeat: int = 50) -> float:
    """Median seconds of one all-reduce of [rows, hidden] float32 on the model's group (on its device)."""
    times = []
    if ranks.framework == "torch":
        import torch
        import torch.distributed as dist

        device = ranks.backend.device
        x = torch.ones(rows, hidden, device=device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        op = lambda: (dist.all_reduce(x), sync())  # noqa: E731
    else:
        import mlx.core as mx

        x = mx.ones((rows, hidden))
        op = lambda: mx.eval(mx.distributed.all_sum(x, group=ranks.backend.group))  # noqa: E731
    for _ in range(repeat + 5):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def child(name: str, folder: Path, sessions: list[int], steps: int, out: Path) -> None:
    """One rank of the 2-rank run (under the launcher)."""
    from kvfork.backends.lockstep import join
    from kvfork.backends.lockstep.follower import Follower
    from kvfork.backends.lockstep.leader import LockstepBackend

    ranks = join(name)
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    allreduce = {n: collective_seconds(ranks, hidden, n) for n in sessions}  # every rank takes part
    if ranks.rank != 0:
        Follower(ranks.backend, ranks.channel).run()
        ranks.close()
        return
    leader = LockstepBackend(ranks.backend, ranks.channel, timeout=600)
    leader.load(str(folder), "float32")
    broadcasts: dict[int, list[float]] = {n: [] for n in sessions}
    last = [leader.broadcast_seconds]

    def on_step(n: int) -> None:
        broadcasts[n].append(leader.broadcast_seconds - last[0])
        last[0] = leader.broadcast_seconds

    def step_start() -> None:
        last[0] = leader.broadcast_seconds

    step = decode_steps(_Hooked(leader, step_start), sessions, steps, on_step)
    leader.stop("done")
    out.write_text(json.dumps({"step_s": step, "broadcast_s": {n: statistics.median(v) for n, v in broadcasts.items()},
                               "allreduce_s": allreduce}))
    ranks.close()


class _Hooked:
    """The leader, with the broadcast clock read just before each decode (so a step's broadcast time is its own)."""

    def __init__(self, leader, before):
        self._leader, self._before = leader, before

    def decode(self, *args):
        self._before()
        return self._leader.decode(*args)

    def __getattr__(self, name):
        return getattr(self._leader, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfork rank-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    parser.add_argument("--shape", default="small", choices=tuple(SHAPES))
    parser.add_argument("--sessions", default="1,4")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="torch: cuda puts rank r on GPU r")
    parser.add_argument("--child", nargs=3, metavar=("ROLE", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sessions = [int(n) for n in args.sessions.split(",")]
    if args.child:
        role, folder, out = args.child
        if role == "one":
            Path(out).write_text(json.dumps(one_process(args.backend, Path(folder), sessions, args.steps)))
        else:
            child(args.backend, Path(folder), sessions, args.steps, Path(out))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvfork-rank-bench-") as tmp:
        folder = write_model(Path(tmp) / "model", SHAPES[args.shape])
        given = argv or sys.argv[1:]
        one = run_child(args.backend, "one", folder, Path(tmp) / "one.json", given, args.device)
        two = run_child(args.backend, "ranks", folder, Path(tmp) / "two.json", given, args.device)
    report(args, SHAPES[args.shape], one, two)
    return 0


def run_child(name: str, role: str, folder: Path, out: Path, argv: list[str], device: str) -> dict:
    """One process, or 2 ranks under the backend's launcher; one thread per process either way."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_dir = Path(sys.executable).parent
    command = [sys.executable, "-m", "kvfork.tools.rank_bench", *argv, "--child", role, str(folder), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", KVFORK_DEVICE=device)
    if name == "torch":
        env["LD_PRELOAD"] = ":".join(p for p in env.get("LD_PRELOAD", "").split(":") if "openblas" not in p)
        launcher = [str(bin_dir / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                    "--master-port", str(port), *command[1:]]
    else:
        launcher = [str(bin_dir / "mlx.launch"), "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1",
                    "--starting-port", str(port), "--", *command]
    subprocess.run(command if role == "one" else launcher, env=env, check=True)
    return {k: {int(n): v for n, v in d.items()} for k, d in json.loads(out.read_text()).items()}


def broadcast_costs(sessions: list[int], chunk: int = 512, repeat: int = 2000) -> list[tuple[str, int, float]]:
    """(step, bytes, encode + decode µs) of the broadcast a step sends: a decode of n rows, a prefill chunk."""
    from kvfork.backends import effects as e
    from kvfork.backends.lockstep import wire

    broadcasts = [(f"decode, {n} rows", wire.Broadcast(1000, [e.Decode(list(range(100, 100 + n)),
                                                                      [30000 + i for i in range(n)])]))
                  for n in sessions]
    broadcasts.append((f"prefill chunk of {chunk}",
                       wire.Broadcast(1000, [e.Prefill([100], [[30000 + i for i in range(chunk)]])])))
    out = []
    for what, broadcast in broadcasts:
        start = time.perf_counter()
        for _ in range(repeat):
            wire.decode(wire.encode(broadcast))
        out.append((what, len(wire.encode(broadcast)), (time.perf_counter() - start) / repeat * 1e6))
    return out


def report(args, shape: dict, one: dict, two: dict) -> None:
    layers = shape["num_hidden_layers"]
    per_step = 2 * layers + (2 if args.backend == "torch" else 0)
    print(f"rank-bench: {args.backend} on {args.device}, {args.shape} shape ({layers} layers, "
          f"hidden {shape['hidden_size']}), context {CONTEXT}, median of {args.steps} decode steps")
    print("| sessions | 1 process ms/step | 2 ranks ms/step | ratio | broadcast ms | "
          f"collective ms (one) | collectives x {per_step} ms | not compute (share of 2-rank step) |")
    print("|---|---|---|---|---|---|---|---|")
    for n in one["step_s"]:
        s1, s2, sent, ar = one["step_s"][n], two["step_s"][n], two["broadcast_s"][n], two["allreduce_s"][n]
        overhead = sent + per_step * ar
        print(f"| {n} | {s1 * 1e3:.2f} | {s2 * 1e3:.2f} | {s2 / s1:.2f} | {sent * 1e3:.3f} | {ar * 1e3:.3f} | "
              f"{per_step * ar * 1e3:.2f} | {overhead * 1e3:.2f} ms ({overhead / s2:.0%}) |")
    print("\n| broadcast | bytes | encode + decode µs |\n|---|---|---|")
    for what, size, micros in broadcast_costs(list(one["step_s"])):
        print(f"| {what} | {size:,} | {micros:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
