"""Torch backend timings on random models of realistic shapes, built in memory (no files, no network).

    python -m kvfork.tools.gpu_check [--shapes 0.5b,7b] [--prompt 2048] [--steps 32] [--device cuda]
        [--kv-cache-dtypes auto,fp8,int8,int4]

Per shape: prefill tokens/s for one prompt, decode tokens/s for 1 and 8 sessions
at that length, and the time of a clone of the whole prompt: its GB/s against
the device's own measured copy bandwidth, and its time against the prefill's.
First, where FlashAttention imports: its attention against torch's SDPA on the
backend's own KV layout (decode, a causal chunk, a sliding chunk), values and time.
Random weights give meaningless tokens but the same work as trained ones.
Per shape too, the memory plan on CUDA (server/engine/policy/memory_plan.py): what the device
reports, the weights' bytes against their parameter count, the activation peak of a full
step measured as the daemon measures it at load, and the KV budget they leave under
--gpu-memory-utilization 0.9.
Then, on the first shape, each --kv-cache-dtype in turn (same seeded weights): its bytes per token,
prefill and decode tokens/s, and how many of `--steps` greedy tokens (after the prompt, then after a
clone of it) match `auto`'s; a clone must answer exactly as its session (reuse is exact at every storage).
`--device cpu --shapes tiny --prompt 64 --steps 4` runs the whole script on a CPU, as a dry run.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvfork.backends.base import KVStorage
from kvfork.backends.model_info import model_facts
from kvfork.backends.torch import attention
from kvfork.backends.torch.backend import DTYPES, TorchBackend, default_dtype
from kvfork.backends.torch.config import parse_config
from kvfork.backends.torch.model import Transformer
from kvfork.server.engine.policy.memory_plan import GiB, plan_memory

# Qwen2.5-0.5B and Mistral-7B shapes (a GQA llama of 7.2B parameters); "tiny" for a dry run on a CPU.
SHAPES = {
    "tiny": dict(
        model_type="qwen2", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1e6, max_position_embeddings=4096,
    ),
    "0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1e6, max_position_embeddings=32768,
    ),
    "7b": dict(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
    ),
}  # fmt: skip


def random_weights(config: dict, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        names = Transformer(parse_config(config), tied=True).state_dict()
    out = {}
    for name, meta in names.items():
        w = torch.empty(meta.shape, device=device, dtype=dtype)
        out[name] = w.fill_(1.0) if name.endswith("norm.weight") else w.normal_(0.0, 0.02)
    return out


class Clock:
    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def copy_bandwidth(device: torch.device, clock: Clock, gib: float = 1.0) -> float:
    """Bytes per second of a plain device-to-device tensor copy (bytes copied, not read + written)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = min(clock(lambda: dst.copy_(src)) for _ in range(5))
    return src.numel() / seconds


def check_flash(device: torch.device, clock: Clock, dtype: torch.dtype) -> None:
    """attention.flash against attention.sdpa on head-major buffers with spare capacity (the KV layout)."""
    kernel = attention.flash_attention()
    if kernel is None:
        print("flash_attn does not import: attention runs on torch SDPA", flush=True)
        return
    heads, kv_heads, dim, keys_n, cap = 32, 8, 128, 2000, 2304
    keys = torch.randn(kv_heads, cap, dim, device=device, dtype=dtype)[:, :keys_n]
    values = torch.randn(kv_heads, cap, dim, device=device, dtype=dtype)[:, :keys_n]
    for name, n, window in (("decode", 1, None), ("chunk 64", 64, None), ("sliding chunk 64, window 512", 64, 512)):
        q = torch.randn(heads, n, dim, device=device, dtype=dtype)
        args = (q, keys, values, keys_n - n, 0, window, dim**-0.5)
        want, got = attention.sdpa(*args), attention.flash(kernel, q, keys, values, window, dim**-0.5)
        sdpa_s = min(clock(lambda: attention.sdpa(*args)) for _ in range(5))
        flash_s = min(clock(lambda: attention.flash(kernel, q, keys, values, window, dim**-0.5)) for _ in range(5))
        print(f"flash vs sdpa, {name} over {keys_n} keys: max |diff| {(got - want).abs().max().item():.2e} | "
              f"{flash_s * 1e6:.0f} us vs {sdpa_s * 1e6:.0f} us", flush=True)


def check_memory(name: str, backend: TorchBackend, step_tokens: int) -> None:
    """The device's reading and the KV budget it gives (the daemon's own calls), checked against torch's figures."""
    reading = backend.memory(step_tokens)
    params_bytes = sum(p.nbytes for p in backend.model.parameters())
    total = torch.cuda.get_device_properties(backend.device).total_memory
    assert reading.kind == "cuda" and reading.total_bytes == total
    assert params_bytes <= reading.weights_bytes <= 1.05 * params_bytes + 2**20, (reading.weights_bytes, params_bytes)
    assert reading.activation_bytes > 0, "a step's activation peak was not measured"
    plan = plan_memory(reading, kv_budget_bytes=None, gpu_memory_utilization=0.9,
                       request_bytes=backend.info.kv.bytes_for(backend.info.context_length))
    left = 0.9 * reading.total_bytes - reading.weights_bytes - reading.activation_bytes
    assert abs(plan.kv_budget_bytes - left) <= 1 and plan.refusal is None, plan
    print(f"{name} memory: {reading.name} {reading.total_bytes / GiB:.2f} GiB, weights "
          f"{reading.weights_bytes / GiB:.2f} GiB, activation peak of a {step_tokens}-token step {reading.activation_bytes / GiB:.2f} GiB -> KV budget "
          f"{plan.kv_budget_bytes / GiB:.2f} GiB ({plan.reason})", flush=True)


def check_shape(name: str, device: torch.device, dtype: str | None, prompt_len: int, steps: int, copy_bps: float) -> None:
    clock = Clock(device)
    backend = TorchBackend(str(device))
    config = SHAPES[name]
    weights_dtype = DTYPES[dtype] if dtype else default_dtype(device)
    built = clock(lambda: backend.install(parse_config(config), random_weights(config, device, weights_dtype), name,
                                                  model_facts(config), dtype))
    params = sum(p.numel() for p in backend.model.parameters())
    if device.type == "cuda":
        check_memory(name, backend, prompt_len)
    prompt = torch.randint(0, config["vocab_size"], (prompt_len,)).tolist()

    warm, warm_len = backend.open_session(), min(256, prompt_len)  # kernels, allocator, cuBLAS plans
    backend.prefill([warm], [prompt[:warm_len]])
    backend.decode([warm], [1])
    backend.release(backend.clone(warm, warm_len))
    backend.release(warm)

    session = backend.open_session()
    prefill_s = clock(lambda: backend.prefill([session], [prompt]))
    clone_s = min(clock(lambda: backend.release(backend.clone(session, prompt_len))) for _ in range(3))
    probe = backend.clone(session, prompt_len)
    clone_bytes = backend.session_bytes(probe)  # what it wrote: a copy's all of it, a shared clone's last block
    backend.release(probe)
    batch = [session] + [backend.clone(session, prompt_len) for _ in range(7)]

    def decode(sessions):
        for _ in range(steps):
            backend.decode(sessions, [1] * len(sessions))

    one_s = clock(lambda: decode(batch[:1]))
    eight_s = clock(lambda: decode(batch))
    print(
        f"{name}: {params / 1e9:.2f}B params {backend.info.dtype}, built in {built:.1f}s | "
        f"prefill {prompt_len} tok: {prompt_len / prefill_s:,.0f} tok/s | "
        f"decode at {prompt_len}: 1 session {steps / one_s:,.1f} tok/s, 8 sessions {8 * steps / eight_s:,.1f} tok/s | "
        f"clone {prompt_len} tok ({clone_bytes / 2**20:,.0f} MiB): {clone_s * 1e3:.2f} ms, "
        f"{clone_bytes / clone_s / 1e9:,.0f} GB/s = {clone_bytes / clone_s / copy_bps:.0%} of copy bandwidth, "
        f"{clone_s / prefill_s:.4f}x the prefill time",
        flush=True,
    )
    for s in batch:
        backend.release(s)


def greedy(backend: TorchBackend, session, logits, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits = backend.decode([session], [out[-1]])
    return out


def check_kv_storages(name: str, device: torch.device, dtype: str | None, prompt_len: int, steps: int,
                      storages: list[str]) -> None:
    """Each KV storage on the same random weights: bytes, speed, greedy agreement with auto, clone exactness."""
    config, clock = SHAPES[name], Clock(device)
    weights_dtype = DTYPES[dtype] if dtype else default_dtype(device)
    prompt = torch.randint(0, config["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    reference: list[int] | None = None
    for storage in storages:
        backend = TorchBackend(str(device))
        backend.set_kv_storage(KVStorage.named(storage))
        torch.manual_seed(0)
        backend.install(parse_config(config), random_weights(config, device, weights_dtype), name, model_facts(config),
                        dtype)
        session = backend.open_session()
        backend.prefill([session], [prompt[:64]])  # warm
        backend.release(session)
        session = backend.open_session()
        logits = [None]
        prefill_s = clock(lambda: logits.__setitem__(0, backend.prefill([session], [prompt])))
        clone = backend.clone(session, prompt_len)
        t0 = time.perf_counter()
        tokens = greedy(backend, session, logits[0], steps)
        decode_s = time.perf_counter() - t0
        cloned = greedy(backend, clone, logits[0], steps)
        assert cloned == tokens, f"{storage}: a clone answered {cloned} where its session answered {tokens}"
        reference = tokens if reference is None else reference
        same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), steps)
        print(f"{name} KV {backend.info.kv_dtype}: {backend.info.kv.full_bytes_per_token:,} bytes/token | prefill "
              f"{prompt_len / prefill_s:,.0f} tok/s | decode {steps / decode_s:,.1f} tok/s | greedy: {same} of {steps} "
              f"as {storages[0]}, the clone's as its session's", flush=True)
        for s in (session, clone):
            backend.release(s)
        del backend
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.5b,7b")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16; default: the backend's")
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8,int8,int4",
                        help="KV storages checked on the first shape, comma separated")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    if device.type == "cuda":
        check_flash(device, Clock(device), DTYPES[args.dtype] if args.dtype else default_dtype(device))
    copy_bps = copy_bandwidth(device, Clock(device))
    print(f"measured copy bandwidth: {copy_bps / 1e9:,.0f} GB/s (bytes copied per second)", flush=True)
    for name in args.shapes.split(","):
        check_shape(name, device, args.dtype, args.prompt, args.steps, copy_bps)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    check_kv_storages(args.shapes.split(",")[0], device, args.dtype, args.prompt, args.steps,
                      args.kv_cache_dtypes.split(","))


if __name__ == "__main__":
    main()
