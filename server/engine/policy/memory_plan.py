"""How many bytes of KV state fit the device: one pure function of what the device reports
(backends/device_memory.py), the flags and the model, so every rule is tested on the readings of
real machines (tests/engine/test_memory_plan.py) and printed at start and in /health with its reason.

- CUDA: `--gpu-memory-utilization` as vLLM means it, the share of the device's total memory
  this instance may use; KV = that share - the loaded weights - the measured activation peak of
  one full step. The host's memory never counts.
- Apple Silicon: Metal's recommended working set (the wired limit is raised to it at load);
  KV = working set - weights - headroom, as the weights share the same memory.
- CPU: CPU_SHARE of physical memory (the rest is the system's and other programs'); KV = that
  - weights - headroom.

Headroom, where activations are not measured, is HEADROOM_FRACTION of the memory the rule starts
from and at least HEADROOM_MIN: a step's activations and the runtime's own buffers.
A model that reads images keeps its vision encoder's output (--encoder-cache-bytes) beside the KV state:
those bytes are taken from what the rule leaves before the KV budget is decided.
`sharers` processes with their own weights dividing one machine's memory (kvfork cluster's
replicas, ranks on one host) each get an equal share of what is left.
`resolve_config` fills in the engine's defaults that follow from the plan and the model, once it is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvfork.backends.base import ModelInfo
from kvfork.backends.device_memory import DeviceMemory, cpu_memory
from kvfork.server.engine.config import CAPTURE_BUDGET_FRACTION, EngineConfig

GiB = 1024**3
CPU_SHARE = 0.75
HEADROOM_FRACTION = 0.1
HEADROOM_MIN = GiB


@dataclass(frozen=True)
class MemoryPlan:
    device: DeviceMemory  # the reading it was decided from
    kv_budget_bytes: int
    reason: str  # one line: where the figure comes from
    available_bytes: int  # the most KV this device holds by the rule, whatever the flags say
    warning: str | None = None  # an explicit budget beyond what the device holds
    refusal: str | None = None  # the budget cannot hold one full-context request: the daemon will not start
    # tokens of full-attention KV the budget holds: in the storage chosen (first), and in each other one
    # --kv-cache-dtype could choose (`budget_tokens`)
    tokens: dict[str, int] = field(default_factory=dict)


def budget_tokens(budget: int, info: ModelInfo) -> dict[str, int]:
    """Tokens of full-attention KV `budget` bytes hold, by storage: the model's own first, then the others
    its backend offers (ModelInfo.kv_token_bytes)."""
    own = info.kv_dtype or info.dtype
    per_token = {own: info.kv.full_bytes_per_token, **dict(info.kv_token_bytes)}
    return {name: budget // n for name, n in per_token.items() if n > 0}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _available(device: DeviceMemory, utilization: float, sharers: int, encoder_cache: int) -> tuple[int, str]:
    """The bytes the device leaves for KV, and how that figure was reached."""
    weights = device.weights_bytes * sharers
    if device.kind == "cuda":
        base = int(utilization * device.total_bytes)
        start = f"{utilization:g} of {device.name}'s {_gib(device.total_bytes)} (--gpu-memory-utilization)"
        spare, spare_text = device.activation_bytes, f"{_gib(device.activation_bytes)} measured activation peak"
    else:
        if device.kind == "metal":
            base = device.working_set_bytes or int(CPU_SHARE * device.total_bytes)
            start = f"{device.name}'s recommended working set {_gib(base)} of {_gib(device.total_bytes)}"
        else:
            base = int(CPU_SHARE * device.total_bytes)
            start = f"{CPU_SHARE:g} of {_gib(device.total_bytes)} physical memory ({device.name})"
        spare = max(device.activation_bytes, HEADROOM_MIN, int(HEADROOM_FRACTION * base))
        spare_text = f"{_gib(spare)} headroom"
    left = max(0, base - weights - spare - encoder_cache * sharers) // sharers
    share = f", split {sharers} ways" if sharers > 1 else ""
    encoder = f" - {_gib(encoder_cache)} encoder cache (--encoder-cache-bytes)" if encoder_cache else ""
    return left, f"{start} - {_gib(weights)} weights - {spare_text}{encoder}{share}"


def plan_memory(device: DeviceMemory, *, kv_budget_bytes: int | None, gpu_memory_utilization: float,
                request_bytes: int, sharers: int = 1, encoder_cache_bytes: int = 0) -> MemoryPlan:
    """The KV budget. `kv_budget_bytes`: --kv-budget-bytes (None: the device's rule); `request_bytes`: one
    request at the full context, which the budget must hold for the daemon to start; `encoder_cache_bytes`:
    the vision encoder's cache each process keeps beside its KV state."""
    available, how = _available(device, gpu_memory_utilization, sharers, encoder_cache_bytes)
    warning = None
    if kv_budget_bytes is not None:
        budget = kv_budget_bytes
        reason = f"--kv-budget-bytes {_gib(kv_budget_bytes)} (the device holds {_gib(available)}: {how})"
        if kv_budget_bytes > available:
            warning = (f"--kv-budget-bytes {_gib(kv_budget_bytes)} is more than this device holds for KV "
                       f"({_gib(available)}: {how}): past that, requests fail or the machine swaps instead of "
                       "queueing")
        flag = "--kv-budget-bytes"
    else:
        budget, reason = available, how
        flag = "--gpu-memory-utilization" if device.kind == "cuda" else "--kv-budget-bytes"
    refusal = None
    if budget < request_bytes:
        refusal = (f"a KV budget of {_gib(budget)} ({reason}) cannot hold one request at the full context "
                   f"({_gib(request_bytes)}): raise {flag} or lower --max-context")
    return MemoryPlan(device, budget, reason, available, warning, refusal)


def shared_host_plan(weights_each: int, sharers: int) -> MemoryPlan:
    """The budget of each of `sharers` processes on this machine's memory, each holding `weights_each` bytes of
    weights (a replica: the model's; a rank: its part), decided before any has loaded."""
    return plan_memory(cpu_memory(weights_each), kv_budget_bytes=None, gpu_memory_utilization=1.0, request_bytes=0,
                       sharers=sharers)


def resolve_config(config: EngineConfig, info: ModelInfo, device: DeviceMemory) -> tuple[EngineConfig, MemoryPlan]:
    """`config` with every machine- or model-dependent default filled in (the KV budget, the context, the
    captures), and the memory plan its KV budget comes from."""
    context = min(config.max_context or info.context_length, info.context_length)
    plan = plan_memory(device, kv_budget_bytes=config.kv_budget_bytes, request_bytes=info.kv.bytes_for(context),
                       gpu_memory_utilization=config.gpu_memory_utilization,
                       encoder_cache_bytes=config.encoder_cache_bytes if info.reads_images else 0)
    budget = plan.kv_budget_bytes
    captures = config.max_captures
    if captures is None:
        snapshot = max(1, info.kv.bytes_for(context, start=context))
        captures = max(1, min(config.inference_slots, int(CAPTURE_BUDGET_FRACTION * budget) // snapshot))
    plan = dataclasses.replace(plan, tokens=budget_tokens(budget, info))
    return dataclasses.replace(config, kv_budget_bytes=budget, max_context=context, max_captures=captures), plan
