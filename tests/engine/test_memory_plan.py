"""The KV budget each device gets (server/engine/policy/memory_plan.py), from readings of real machines: what
Metal, CUDA and the kernel report on them, with the weights of a model each would serve."""

from __future__ import annotations

import pytest

from kvfork.backends.device_memory import DeviceMemory, cpu_memory
from kvfork.server.engine.policy.memory_plan import GiB, plan_memory

MiB = 1024**2
# (device, weights): readings as each machine reports them
MAC_8GB = DeviceMemory("metal", "Apple M2", 8 * GiB, 8 * GiB, working_set_bytes=5_726_633_984,
                       weights_bytes=1_720_000_000)  # a 3B model in 4 bits
MAC_64GB = DeviceMemory("metal", "Apple M2 Max", 64 * GiB, 64 * GiB, working_set_bytes=51_539_607_552,
                        weights_bytes=40 * GiB)  # the 40 GB model
RTX_4090 = DeviceMemory("cuda", "NVIDIA GeForce RTX 4090", 25_393_692_672, 128 * GiB,
                        weights_bytes=15_230_000_000, activation_bytes=1_100 * MiB)  # an 8B model in bf16
H100_80GB = DeviceMemory("cuda", "NVIDIA H100 80GB HBM3", 85_029_158_912, 2048 * GiB,
                         weights_bytes=16_060_000_000, activation_bytes=2_300 * MiB)
# this repository's CI machine with the default model on torch (float32, projections packed for oneDNN)
CPU_23GB = DeviceMemory("cpu", "CPU (2 cores)", 25_275_990_016, 25_275_990_016, weights_bytes=651_306_240)


def plan(device: DeviceMemory, budget: int | None = None, utilization: float = 0.9, request: int = 0, sharers: int = 1):
    return plan_memory(device, kv_budget_bytes=budget, gpu_memory_utilization=utilization, request_bytes=request,
                       sharers=sharers)


@pytest.mark.parametrize("device, expected_gib, says", [
    # working set 5.33 GiB - 1.60 GiB weights - 1 GiB headroom (a tenth of the set is less than the floor)
    (MAC_8GB, 2.73, "recommended working set 5.33 GiB of 8.00 GiB"),
    # 48 GiB working set - 40 GiB weights - 4.8 GiB headroom: not half of 64 GiB on top of the weights
    (MAC_64GB, 3.20, "recommended working set 48.00 GiB of 64.00 GiB"),
    # 0.9 x 23.65 GiB - 14.18 GiB weights - 1.07 GiB activations; the host's 128 GiB never counts
    (RTX_4090, 6.03, "0.9 of NVIDIA GeForce RTX 4090's 23.65 GiB (--gpu-memory-utilization)"),
    (H100_80GB, 54.06, "2.25 GiB measured activation peak"),
    # 0.75 x 23.54 GiB - 0.61 GiB weights - 1.77 GiB headroom (a tenth of the 17.66 GiB)
    (CPU_23GB, 15.28, "0.75 of 23.54 GiB physical memory"),
])
def test_each_device_gets_what_its_memory_leaves_once_the_weights_are_in(device, expected_gib, says):
    p = plan(device)
    assert p.kv_budget_bytes / GiB == pytest.approx(expected_gib, abs=0.01)
    assert p.kv_budget_bytes == p.available_bytes and p.warning is None and p.refusal is None
    assert says in p.reason and "weights" in p.reason


def test_cuda_follows_the_utilization_and_never_the_host():
    small_host = DeviceMemory(**{**RTX_4090.__dict__, "host_bytes": 8 * GiB})
    assert plan(small_host).kv_budget_bytes == plan(RTX_4090).kv_budget_bytes
    lower = plan(RTX_4090, utilization=0.8).kv_budget_bytes
    assert plan(RTX_4090).kv_budget_bytes - lower == pytest.approx(0.1 * RTX_4090.total_bytes, abs=1)


def test_weights_beyond_the_device_leave_nothing_and_the_start_is_refused_naming_the_flag():
    too_big = DeviceMemory(**{**MAC_8GB.__dict__, "weights_bytes": 6 * GiB})
    p = plan(too_big, request=100 * MiB)
    assert p.kv_budget_bytes == 0 and "raise --kv-budget-bytes or lower --max-context" in p.refusal
    p = plan(RTX_4090, utilization=0.62, request=2 * GiB)  # 0.62 x 23.65 - 14.18 - 1.07 = 0.41 GiB
    assert "raise --gpu-memory-utilization or lower --max-context" in p.refusal


def test_a_budget_that_holds_one_full_context_request_starts():
    assert plan(CPU_23GB, request=14 * GiB).refusal is None
    assert plan(CPU_23GB, budget=64 * MiB, request=65 * MiB).refusal.startswith("a KV budget of 0.06 GiB")


def test_an_explicit_budget_wins_and_one_beyond_the_device_is_warned_of():
    p = plan(RTX_4090, budget=4 * GiB)
    assert p.kv_budget_bytes == 4 * GiB and p.warning is None and p.reason.startswith("--kv-budget-bytes 4.00 GiB")
    p = plan(RTX_4090, budget=64 * GiB)
    assert p.kv_budget_bytes == 64 * GiB and "more than this device holds for KV (6.03 GiB" in p.warning


def test_a_model_that_reads_images_reserves_its_encoder_cache_out_of_the_kv_budget():
    text = plan(RTX_4090)
    vision = plan_memory(RTX_4090, kv_budget_bytes=None, gpu_memory_utilization=0.9, request_bytes=0,
                         encoder_cache_bytes=256 * MiB)
    assert text.kv_budget_bytes - vision.kv_budget_bytes == 256 * MiB
    assert "- 0.25 GiB encoder cache (--encoder-cache-bytes)" in vision.reason
    assert "encoder cache" not in text.reason


def test_processes_sharing_one_machine_split_what_all_their_weights_leave():
    one, two = plan(CPU_23GB), plan(CPU_23GB, sharers=2)
    assert two.kv_budget_bytes == (one.kv_budget_bytes - CPU_23GB.weights_bytes) // 2
    assert "split 2 ways" in two.reason


def test_this_machine():
    device = cpu_memory(weights_bytes=GiB)
    p = plan(device)
    assert device.kind == "cpu" and device.total_bytes == device.host_bytes > 0
    assert 0 < p.kv_budget_bytes < device.total_bytes - GiB


def test_each_backend_reports_its_loaded_weights(tiny_model_dir):
    from kvfork.backends import create_backend
    from kvfork.backends.device_memory import weights_on_disk

    folder = tiny_model_dir("llama")
    readings = {}
    for name in ("mlx", "torch"):
        backend = create_backend(name)
        backend.load(folder, "float32")
        readings[name] = backend.memory(0)
    on_disk = weights_on_disk(folder)  # the tensors and the file's header
    assert on_disk - 64 * 1024 < readings["mlx"].weights_bytes <= on_disk
    # torch on a CPU holds each projection in oneDNN's layout, and a packed copy of a tied embedding as its head
    assert readings["torch"].weights_bytes >= readings["mlx"].weights_bytes
    assert all(r.total_bytes > r.weights_bytes and r.kind in ("cpu", "metal", "cuda") for r in readings.values())
