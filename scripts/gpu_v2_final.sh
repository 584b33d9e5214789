#!/usr/bin/env bash
# GPU host, one device call (contract v2 kernels, when the device time does not allow the
# whole `python3 -m ci.pipeline kernels`): the v2 harness (checks + timing), the GPU test
# suite (v2 tests first), compute-sanitizer memcheck and racecheck on the bad-input corpus
# (extended to the v2 layouts), on the library built on the CPU machine. Knobs:
# HARNESS_BUDGET_S (timing budget, 60), PYTEST_S (230), RACECHECK ("select attention"; empty: none)
# (custom_esimd_kernels_vllm/_C.so, carried). Logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 QSA_BACKEND=cuda
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
hb=${HARNESS_BUDGET_S:-60}
timeout $((hb + 60)) python3 scripts/v2_harness.py --check --time --out "$OUT" --budget "$hb" \
  > "$OUT/harness.log" 2>&1; echo "harness rc=$?"; grep -E "checks:|FAIL" "$OUT/harness.log" | head
timeout "${PYTEST_S:-230}" python3 -m pytest -q -p no:cacheprovider -rf \
  --junitxml="$OUT/junit.xml" tests/gpu/test_v2_gpu.py tests/gpu "$@" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -15 "$OUT/pytest.log"
cd tests/gpu
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
timeout 80 compute-sanitizer --error-exitcode 99 --tool memcheck --kernel-name kns=qsa \
  python3 sanitizer_corpus.py all > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"
tail -4 "$OUT/memcheck.log"
for m in ${RACECHECK-select attention}; do
  timeout 50 compute-sanitizer --error-exitcode 99 --tool racecheck --racecheck-report all \
    --kernel-name "kns=$( [[ $m == select ]] && echo select_kernel || echo attention )" \
    python3 sanitizer_corpus.py $m > "$OUT/racecheck-$m.log" 2>&1; echo "racecheck $m rc=$?"
  tail -3 "$OUT/racecheck-$m.log"
done
