"""Torch backend timings on a hybrid model of Qwen3.5-0.8B's layer sizes, random weights in memory.

    python -m kvfork.tools.hybrid_bench [--prompt 512] [--steps 16] [--device cpu] [--dtype float32]

The delta rule of one layer alone in both forms, then the whole model: prefill tok/s
with the delta rule's chunked form (what prefill runs) against its
token-by-token recurrent form, decode tok/s for 1 and 4 sessions, bytes per token
of the full-attention layers, bytes of one session's recurrent state, and the time
of a clone at the session's position against the prefill's.
"""

from __future__ import annotations

import argparse

import torch

from kvfork.backends.torch.backend import DTYPES, TorchBackend, default_dtype
from kvfork.backends.model_info import model_facts
from kvfork.backends.torch.config import parse_config
from kvfork.backends.torch.gated_delta import chunked_delta_rule, l2_normalize, recurrent_delta_rule
from kvfork.backends.torch.hybrid import HybridTransformer
from kvfork.tools.gpu_check import Clock

# Qwen3.5-0.8B-like: 24 layers, every 4th gated full attention (6 of them), the rest Gated DeltaNet.
SHAPE = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    full_attention_interval=4, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=True,
)  # fmt: skip


def random_weights(config: dict, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        names = HybridTransformer(parse_config(dict(config, model_type="qwen3_5")), tied=True).state_dict()
    out = {}
    for name, meta in names.items():
        w = torch.empty(meta.shape, device=device, dtype=dtype)
        if name.endswith("linear_attn.norm.weight"):
            out[name] = w.fill_(1.0)
        elif name.endswith("norm.weight"):
            out[name] = w.fill_(0.0)  # zero-centred
        elif name.endswith("A_log"):
            out[name] = w.uniform_(0.0, 2.7)  # log of A in [1, 16]
        else:
            out[name] = w.normal_(0.0, 0.02)
    return out


def rule_seconds(tokens: int, device: torch.device, clock: Clock) -> tuple[float, float]:
    """One DeltaNet layer's rule alone (16 heads, 128 x 128 state), float32: (chunked s, recurrent s)."""
    heads, dim = SHAPE["linear_num_value_heads"], SHAPE["linear_key_head_dim"]
    q, k = (l2_normalize(torch.randn(1, tokens, heads, dim, device=device)) for _ in range(2))
    v = torch.randn(1, tokens, heads, dim, device=device)
    log_decay, beta = -torch.rand(1, tokens, heads, device=device), torch.rand(1, tokens, heads, device=device)
    state = torch.zeros(1, heads, dim, dim, device=device)
    with torch.inference_mode():
        chunked = min(clock(lambda: chunked_delta_rule(q, k, v, log_decay, beta, state)) for _ in range(3))
        recurrent = min(clock(lambda: recurrent_delta_rule(q, k, v, log_decay, beta, state)) for _ in range(3))
    return chunked, recurrent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16; default: the backend's")
    parser.add_argument("--rule-only", action="store_true", help="time the delta rule's two forms only")
    args = parser.parse_args()
    device = torch.device(args.device)
    clock = Clock(device)
    chunked_s, recurrent_s = rule_seconds(args.prompt, device, clock)
    print(f"delta rule of one layer, {args.prompt} tokens: chunked {args.prompt / chunked_s:,.0f} tok/s, "
          f"recurrent {args.prompt / recurrent_s:,.0f} tok/s ({recurrent_s / chunked_s:.1f}x)", flush=True)
    if args.rule_only:
        return
    backend = TorchBackend(str(device))
    weights_dtype = DTYPES[args.dtype] if args.dtype else default_dtype(device)
    config = dict(SHAPE, model_type="qwen3_5")
    weights = random_weights(SHAPE, device, weights_dtype)
    backend.install(parse_config(config), weights, "qwen3.5-0.8b-shape", model_facts(config), args.dtype)
    params = sum(p.numel() for p in backend.model.parameters())
    info = backend.info
    prompt = torch.randint(0, SHAPE["vocab_size"], (args.prompt,)).tolist()

    warm = backend.open_session()  # kernels, allocator
    backend.prefill([warm], [prompt[:64]])
    backend.decode([warm], [1])
    backend.release(warm)

    def prefill_seconds(chunked: bool) -> float:
        backend.model.set_chunked_prefill(chunked)
        session = backend.open_session()
        seconds = clock(lambda: backend.prefill([session], [prompt]))
        backend.release(session)
        return seconds

    recurrent_s = prefill_seconds(False)
    chunked_s = prefill_seconds(True)
    session = backend.open_session()
    backend.prefill([session], [prompt])
    clone_s = min(clock(lambda: backend.release(backend.clone(session, args.prompt))) for _ in range(3))
    batch = [session] + [backend.clone(session, args.prompt) for _ in range(3)]

    def decode(sessions):
        for _ in range(args.steps):
            backend.decode(sessions, [1] * len(sessions))

    one_s = clock(lambda: decode(batch[:1]))
    four_s = clock(lambda: decode(batch))
    print(
        f"{params / 1e9:.2f}B params {info.dtype} on {info.device}, threads {torch.get_num_threads()} | "
        f"prefill {args.prompt} tok: chunked {args.prompt / chunked_s:,.0f} tok/s, "
        f"recurrent {args.prompt / recurrent_s:,.0f} tok/s ({recurrent_s / chunked_s:.1f}x the time) | "
        f"decode at {args.prompt}: 1 session {args.steps / one_s:,.1f} tok/s, "
        f"4 sessions {4 * args.steps / four_s:,.1f} tok/s | "
        f"KV {info.kv.full_bytes_per_token:,} B/token (6 full layers), recurrent state {info.kv.state_bytes:,} B/session "
        f"(= {info.kv.state_bytes / info.kv.full_bytes_per_token:,.0f} tokens of KV) | "
        f"clone at {args.prompt}: {clone_s * 1e3:.2f} ms = {clone_s / chunked_s:.4f}x the prefill time",
        flush=True,
    )
    for s in batch:
        backend.release(s)


if __name__ == "__main__":
    main()
