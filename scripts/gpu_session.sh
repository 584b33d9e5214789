#!/usr/bin/env bash
# One GPU session: build the kernels, test, sanitize, time; everything logged under $OUT.
#
#   bash scripts/gpu_session.sh validate    build + GPU suite + sanitizers + timing
#                                           -> results/gpu-validation.json (and $OUT/)
#   bash scripts/gpu_session.sh dev [pytest args]   build + GPU suite + sanitizers + timing + splits sweep
#   bash scripts/gpu_session.sh test [pytest args]  build + GPU suite only
#   bash scripts/gpu_session.sh bench               build + timing only
#
# Environment: OUT (log folder; default .work/gpu), PYTHON (default python3),
# QSA_COMMIT / QSA_TREE_DIRTY (recorded when the checkout has no git metadata).
set -uo pipefail
MODE="${1:-validate}"
shift || true
OUT="${OUT:-$PWD/.work/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() { echo "== $(date +%H:%M:%S) $*"; }
fail() { echo "!! $*"; status=1; }

build() {
  step "build (nvcc $(nvcc --version | tail -n 1))"
  rm -rf build custom_esimd_kernels_vllm/_C.so
  "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -n 40 "$OUT/build.log"; return 1; }
  "$PY" - <<'PY'
from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import provenance
info = qsa_ops.build_info()
assert info["cuda_available"], info["cuda_reason"]
print("build_info:", info["cuda_build"])
print("dso sha256:", provenance.loaded_dso()["sha256"])
PY
}

gpu_tests() {
  step "pytest tests/gpu $*"
  timeout "${QSA_PYTEST_TIMEOUT:-400}" "$PY" -m pytest tests/gpu -q -rfE -p no:cacheprovider --junitxml="$OUT/junit.xml" "$@" \
    2>&1 | tee "$OUT/pytest.log" | grep -vE '^\.|^$' | tail -n 60
  return "${PIPESTATUS[0]}"
}

sanitize() {
  step "compute-sanitizer memcheck (all kernels) + racecheck (selection)"
  local mem=clean race=clean
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 \
    --kernel-name kns=qsa "$PY" tests/gpu/sanitizer_corpus.py all >"$OUT/memcheck.log" 2>&1 || mem="failed"
  timeout 150 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 99 \
    --kernel-name kns=select_rows_kernel "$PY" tests/gpu/sanitizer_corpus.py select \
    >"$OUT/racecheck.log" 2>&1 || race="failed"
  tail -n 3 "$OUT/memcheck.log" "$OUT/racecheck.log"
  printf '{"memcheck": "%s", "racecheck": "%s"}\n' "$mem" "$race" >"$OUT/sanitizer.json"
  [ "$mem" = clean ] && [ "$race" = clean ]
}

timing() {
  step "timing $*"
  timeout 200 "$PY" -m custom_esimd_kernels_vllm.bench --validation "$OUT/timing.json" \
    --out-dir "$OUT/bench" --no-progress "$@" 2>&1 | tee "$OUT/timing.log"
  return "${PIPESTATUS[0]}"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
case "$MODE" in
  validate)
    build || exit 1
    gpu_tests "$@" || fail "GPU tests"
    sanitize || fail "sanitizer"
    timing || fail "timing"
    "$PY" scripts/gpu_validation.py --junit "$OUT/junit.xml" --sanitizer "$OUT/sanitizer.json" \
      --timing "$OUT/timing.json" --output results/gpu-validation.json || fail "validation record"
    cp results/gpu-validation.json "$OUT/" ;;
  dev)
    build || exit 1
    QSA_PYTEST_TIMEOUT=300 gpu_tests "$@" || fail "GPU tests"
    timing --splits-sweep || fail "timing"
    sanitize || fail "sanitizer" ;;
  test)
    build || exit 1
    gpu_tests "$@" || fail "GPU tests" ;;
  perf)
    build || exit 1
    timing --splits-sweep || fail "timing"
    sanitize || fail "sanitizer" ;;
  bench)
    build || exit 1
    timing "$@" || fail "timing" ;;
  *)
    echo "usage: $0 validate|dev|test|bench [pytest args]" >&2
    exit 2 ;;
esac
step "done (status $status)"
exit "$status"
