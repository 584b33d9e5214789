#!/usr/bin/env bash
# GPU host, one device call: the v2 harness (checks, then timing) and the v2 GPU tests on the
# library built on the CPU machine (custom_esimd_kernels_vllm/_C.so, carried). Logs in $OUT.
#   bash scripts/gpu_v2_run.sh [HARNESS_BUDGET_S] [PYTEST_ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${1:-240}
shift || true
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
timeout $((budget + 150)) python3 scripts/v2_harness.py --check --time --out "$OUT" \
  --budget "$budget" 2>&1 | tee "$OUT/harness.log"
if [[ $# -gt 0 ]]; then
  QSA_BACKEND=cuda timeout 200 python3 -m pytest -q -x -p no:cacheprovider "$@" 2>&1 \
    | tee "$OUT/pytest.log" | tail -30
fi
