"""The Gated DeltaNet layer (Yang, Kautz, Hatamizadeh 2024), as Qwen3.5 and Qwen3-Next use it.

Per value head the layer keeps a state S of shape [Dk, Dv] (a fast-weight memory
from keys to values). At each token t, with decay g_t in (0, 1] and write
strength beta_t in (0, 1):

    S_t = g_t S_{t-1} + beta_t k_t (v_t - g_t S_{t-1}^T k_t)^T      (the gated delta rule)
    o_t = S_t^T q_t

Decode runs that recurrence one token at a time (`recurrent_delta_rule`).
Prefill runs its chunked form (`chunked_delta_rule`): within a chunk of C tokens
the writes w_t = beta_t (v_t - ...) solve one unit-lower-triangular system (the
WY/UT form), so a chunk costs a few matmuls and only the chunk boundaries are
sequential. Both forms compute the same thing; the tests hold them to it.

Before the rule: a short causal depthwise convolution over [q; k; v] (its last
K - 1 inputs are the conv state) and q, k L2-normalised. After it: an RMS norm
gated by silu(z), then the output projection.

On CUDA the flash-linear-attention kernels (`fla-core`) run the rule when they
import; the plain torch forms are the reference and the CPU path.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvfork.backends.torch.kv import state_copy, state_memory

from kvfork.backends.torch.config import HybridConfig

CHUNK = 64  # tokens per chunk of the chunked form


class RecurrentState:
    """One Gated DeltaNet layer's state for one session: fixed size, whatever the position.

    conv: the last K - 1 inputs of the causal convolution, [K - 1, conv_dim], model dtype.
    ssm: the delta-rule state, [v_heads, Dk, Dv], always float32 (as mlx-lm and fla keep it).
    Neither can be cut back to an earlier position, so a copy is only ever of the whole
    state (the recurrent rule, base.clone_positions: a clone at the session's position, or at a checkpoint).
    Both are written in place: `writes` counts the writes begun, so a failed pass tells a session
    it changed (CORRUPT) from one it never reached (UNTOUCHED).
    """

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor):
        self.conv, self.ssm = conv, ssm
        self.writes = 0

    @classmethod
    def empty(cls, cfg: HybridConfig, dtype, device) -> RecurrentState:
        conv_dim = 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim
        conv = state_memory((cfg.conv_kernel - 1, conv_dim), dtype, device, zeroed=True)
        ssm = state_memory((cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim), torch.float32, device, zeroed=True)
        return cls(conv, ssm)

    def reserve(self, end: int) -> None:
        """Fixed size: never grows."""

    def copy_prefix(self, upto: int) -> RecurrentState:
        return RecurrentState(state_copy(self.conv), state_copy(self.ssm))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.conv, self.ssm


def recurrent_delta_rule(q, k, v, g, beta, state):
    """The rule token by token. q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; g (log decay), beta:
    [B, T, H]; state: [B, H, Dk, Dv] float32. Returns o [B, T, H, Dv] and the new state."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None].exp()
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        written = (v[:, t] - recalled) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * written[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1), state


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same rule, a chunk at a time. Shapes as `recurrent_delta_rule`.

    Within a chunk, with Gamma_i the decay accumulated from the chunk's start to token i
    and S_0 the state before it, the writes W (rows w_i) satisfy
        (I + diag(beta) L) W = diag(beta) (V - diag(Gamma) K S_0),
        L_ij = (Gamma_i / Gamma_j) k_i.k_j for j < i,
    and then
        O   = diag(Gamma) Q S_0 + (Q K^T * D) W,     D_ij = Gamma_i / Gamma_j for j <= i,
        S_C = Gamma_C S_0 + (K * Gamma_C / Gamma)^T W.
    Padding the tail with k = v = 0, beta = 0, log g = 0 changes neither outputs nor state.
    """
    b, t, h, dk = k.shape
    pad = -t % chunk
    q, k, v, g, beta = (F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g, beta))
    n = (t + pad) // chunk
    # [B, H, N, C, ...]: heads ahead of chunks, so matmuls batch over (B, H, N).
    q, k, v = (x.reshape(b, n, chunk, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.reshape(b, n, chunk, h).permute(0, 3, 1, 2) for x in (g, beta))

    # Decays accumulate in float64: Gamma_i / Gamma_j is a difference of two long sums of
    # log decays, and in float32 it would lose the digits the recurrent form keeps.
    log_gamma = g.double().cumsum(-1)  # [B, H, N, C]
    i = torch.arange(chunk, device=q.device)
    past = i[:, None] > i[None, :]  # j < i
    seen = i[:, None] >= i[None, :]  # j <= i
    log_ratio = log_gamma[..., :, None] - log_gamma[..., None, :]
    decay_past = log_ratio.masked_fill(~past, float("-inf")).exp().to(q.dtype)
    decay_seen = log_ratio.masked_fill(~seen, float("-inf")).exp().to(q.dtype)
    gamma = log_gamma.exp().to(q.dtype)[..., None]
    to_end = (log_gamma[..., -1:] - log_gamma).exp().to(q.dtype)[..., None]

    lower = beta[..., None] * (k @ k.transpose(-1, -2)) * decay_past
    system = torch.eye(chunk, device=q.device, dtype=q.dtype) + lower
    solve = functools.partial(torch.linalg.solve_triangular, system, upper=False, unitriangular=True)
    values = solve(beta[..., None] * v)  # the W of a zero S_0
    keys = solve(beta[..., None] * gamma * k)  # how S_0 enters W: W = values - keys S_0
    scores = (q @ k.transpose(-1, -2)) * decay_seen
    q_decayed, k_to_end = q * gamma, k * to_end
    chunk_decay = gamma[..., -1, :, None]  # Gamma_C: [B, H, N, 1, 1]

    outs = []
    for c in range(n):  # only the hand-over of S between chunks is sequential
        written = values[:, :, c] - keys[:, :, c] @ state
        outs.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ written)
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ written
    out = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(b, n * chunk, h, -1)
    return out[:, :t], state


@functools.cache
def _fla():
    """flash-linear-attention's kernels, or None where they do not import (no CUDA, not installed)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def delta_rule(q, k, v, g, beta, state, chunked: bool):
    """Dispatch: fla's kernels on CUDA when present, else the plain forms above (in float32)."""
    kernels = _fla() if q.is_cuda else None
    if kernels is not None:
        chunk_kernel, recurrent_kernel = kernels
        kernel = chunk_kernel if chunked else recurrent_kernel
        out, state = kernel(q, k, v, g=g, beta=beta, scale=1.0, initial_state=state, output_final_state=True)
        return out, state.float()
    form = chunked_delta_rule if chunked else recurrent_delta_rule
    out, state = form(q.float(), k.float(), v.float(), g.float(), beta.float(), state)
    return out.to(v.dtype), state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """rms_norm(o) * w * silu(z), per value head (w is stored as is, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Module names as the Qwen3.5 checkpoints (Qwen3-Next's fused projections are split at load)."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.k_heads, self.v_heads = cfg.linear_k_heads, cfg.linear_v_heads
        self.k_dim, self.v_dim = cfg.linear_k_dim, cfg.linear_v_dim
        key_size, value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_dim = 2 * key_size + value_size
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, value_size, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(value_size, cfg.hidden_size, bias=False)
        self.chunked_prefill = True  # False runs prefill token by token (for measurements)

    def forward(self, x: torch.Tensor, states: Sequence[RecurrentState]) -> torch.Tensor:
        b, n, _ = x.shape
        mixed = self._convolve(self.in_proj_qkv(x), states)
        q, k, v = mixed.split([self.k_heads * self.k_dim, self.k_heads * self.k_dim, self.v_heads * self.v_dim], -1)
        q = l2_normalize(q.reshape(b, n, self.k_heads, self.k_dim)) * self.k_dim**-0.5
        k = l2_normalize(k.reshape(b, n, self.k_heads, self.k_dim))
        v = v.reshape(b, n, self.v_heads, self.v_dim)
        if self.v_heads > self.k_heads:  # grouped: each key head serves consecutive value heads
            q, k = (x.repeat_interleave(self.v_heads // self.k_heads, dim=2) for x in (q, k))
        beta = torch.sigmoid(self.in_proj_b(x).float())
        log_g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        ssm = torch.stack([s.ssm for s in states])
        out, ssm = delta_rule(q, k, v, log_g, beta, ssm, chunked=n > 1 and self.chunked_prefill)
        for s, new in zip(states, ssm):
            s.writes += 1  # before the first byte moves
            s.ssm.copy_(new)
        z = self.in_proj_z(x).reshape(b, n, self.v_heads, self.v_dim)
        return self.out_proj(self.norm(out, z).reshape(b, n, -1))

    def _convolve(self, mixed: torch.Tensor, states: Sequence[RecurrentState]) -> torch.Tensor:
        """silu(causal depthwise conv) over each row's held inputs then its new ones; keeps the last K - 1."""
        held = torch.stack([s.conv for s in states])  # [B, K - 1, C]
        inputs = torch.cat((held, mixed), dim=1)
        for s, row in zip(states, inputs):
            s.writes += 1  # before the first byte moves
            s.conv.copy_(row[-held.shape[1] :])
        # Tap by tap rather than F.conv1d: torch's CPU depthwise convolution took ~50 ms for one
        # decode step of 6,144 channels. out[t] = sum_j w[:, j] * inputs[t + j] (cross-correlation).
        taps = self.conv1d.weight[:, 0, :]  # [C, K]
        n = mixed.shape[1]
        out = sum(inputs[:, j : j + n] * taps[:, j] for j in range(taps.shape[1]))
        return F.silu(out)
