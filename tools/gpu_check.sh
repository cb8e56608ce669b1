#!/usr/bin/env bash
# CUDA check of the torch backend, for a GPU machine with only torch, transformers,
# safetensors and pytest installed and no network. Under 5 minutes on one modern GPU:
#   1. the backend contract tests and the torch backend's own, with KVFORK_DEVICE=cuda
#      (MLX rows and mlx-lm parity tests skip without MLX; tests/tiny_models.py then
#      takes parameter shapes from our model code);
#   2. FlashAttention against SDPA where flash_attn imports, then timings on random ~0.5B and ~7B-shaped models built in memory (tools/gpu_check.py):
#      prefill and decode tokens/s, clone GB/s against the card's measured copy bandwidth.
# Usage: tools/gpu_check.sh [tools/gpu_check.py options]; PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'

echo "== torch backend tests on cuda"
KVFORK_DEVICE=cuda timeout 150 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_backends.py tests/test_backend_sampling.py \
    tests/test_torch_backend.py tests/test_torch_sampling.py tests/test_torch_parity.py tests/test_torch_mixed.py

echo "== timings (random weights)"
timeout 120 "$PY" -m tools.gpu_check "$@"
