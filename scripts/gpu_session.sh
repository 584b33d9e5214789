#!/usr/bin/env bash
# The GPU host's session, as the pipeline's GPU steps (ci/pipeline.py); no nox needed there.
#
#   bash scripts/gpu_session.sh validate [WHEEL] [PYTEST ARGS]
#       = python3 -m ci.pipeline kernels --wheel WHEEL [PYTEST ARGS]
#         the CPU machine's wheel, installed unrebuilt: provenance check, tests/gpu,
#         compute-sanitizer memcheck + racecheck, the benchmark's timing
#         -> results/gpu-validation.json
#   bash scripts/gpu_session.sh bench [BENCH ARGS]
#       = python3 -m ci.pipeline bench [BENCH ARGS]
#
# WHEEL defaults to the one dist/*.whl; PYTHON (default python3) is the interpreter with torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
MODE="${1:-validate}"
shift || true
case "$MODE" in
  validate)
    if [[ $# -gt 0 && $1 == *.whl ]]; then
      wheel=$1
      shift
      exec "$PY" -m ci.pipeline kernels --wheel "$wheel" "$@"
    fi
    exec "$PY" -m ci.pipeline kernels "$@" ;;
  bench)
    exec "$PY" -m ci.pipeline bench "$@" ;;
  -h|--help)
    echo "usage: $0 validate [WHEEL] [PYTEST ARGS] | bench [BENCH ARGS]"
    echo "(validate --help, bench --help: the step's own arguments)" ;;
  *)
    echo "usage: $0 validate [WHEEL] [PYTEST ARGS] | bench [BENCH ARGS]" >&2
    exit 2 ;;
esac
