#!/usr/bin/env bash
# CUDA check of the torch backend, for a GPU machine with only torch, transformers,
# safetensors and pytest installed and no network. Under 5 minutes on one modern GPU:
#   1. the backend contract tests and the torch backend's own, with KVFORK_DEVICE=cuda, its KV storages
#      among them (--kv-cache-dtype fp8, int8, int4: every reuse path answering as the writer); MLX rows
#      and mlx-lm parity tests skip without MLX; tests/tiny_models.py then takes parameter shapes from
#      our model code;
#   2. FlashAttention against SDPA where flash_attn imports, then timings on random ~0.5B and ~7B-shaped models built in memory (tools/gpu_check.py):
#      prefill and decode tokens/s, clone GB/s against the card's measured copy bandwidth; the memory plan
#      (the device's reading, the weights, a step's measured activation peak, the KV budget under
#      --gpu-memory-utilization 0.9), checked against torch's own figures; then fp8, int8 and int4 KV on the
#      0.5B shape: bytes per token, speed, greedy agreement with the weights' dtype, a clone exact;
#   3. with 2 GPUs or more: one model over 2 of them (tensor parallel, NCCL; plans over gloo): the 2-rank
#      backend tests on GPUs 0 and 1, then decode steps of a 0.5B-shaped model on 1 GPU against 2, with
#      the plan broadcast and one NCCL all-reduce timed (tools/rank_bench.py). About 3 minutes.
# Usage: tools/gpu_check.sh [tools/gpu_check.py options]; PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'

echo "== torch backend tests on cuda"
KVFORK_DEVICE=cuda timeout 150 "$PY" -m pytest -q -p no:cacheprovider \
    tests/backends/test_contract.py tests/backends/test_sampling.py tests/backends/test_torch_backend.py \
    tests/backends/test_torch_sampling.py tests/backends/test_torch_parity.py tests/backends/test_torch_mixed.py \
    tests/backends/test_kv_storage.py

echo "== timings (random weights)"
timeout 120 "$PY" -m kvfork.tools.gpu_check "$@"

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)'; then
    echo "== 2 GPUs: tensor parallel over NCCL"
    KVFORK_DEVICE=cuda timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/cluster/test_distributed_backends.py -k torch
    KVFORK_DEVICE=cuda timeout 240 "$PY" -m kvfork.tools.rank_bench --backend torch --device cuda --shape 0.5b --sessions 1,8
else
    echo "== 2 GPUs: skipped (torch sees $("$PY" -c 'import torch; print(torch.cuda.device_count())') CUDA device)"
fi
