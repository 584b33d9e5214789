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
#   bash scripts/gpu_session.sh record WHEEL [BENCH ARGS]
#       the GPU validation record of WHEEL in one call: the benchmark's dtype grid beside
#       upstream vLLM's kernels in the same dtype (bench --grid dtype, the upstream modules
#       from $QSA_UPSTREAM or an installed vllm), then validate
#       -> results/bench-dtype-<gpu>.{json,md,png}, results/gpu-validation.json
#   bash scripts/gpu_session.sh ab OUTDIR CASES BUILDS [TIME ARGS]
#       candidates (BUILDS: alt_NAME, comma list) of the development shims that
#       scripts/build_v2_harness.sh built into .harness, each in its own processes beside this
#       tree's build (new): scripts/v2_harness.py --check (against the float64 / bit-exact
#       references), --once CASES under ncu (kernel durations, clocks locked) and its
#       --ab-report, then --time TIME ARGS (graph replay) when given; logs and JSON under
#       OUTDIR/NAME
#
# WHEEL defaults to the one dist/*.whl; PYTHON (default python3) is the interpreter with torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
usage() {
  echo "usage: $0 validate [WHEEL] [PYTEST ARGS] | bench [BENCH ARGS] | record WHEEL [BENCH ARGS]"
  echo "       | ab OUTDIR CASES BUILDS [TIME ARGS]"
}
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
  record)
    if [[ ${1:-} == -h || ${1:-} == --help ]]; then
      echo "usage: $0 record WHEEL [BENCH ARGS] (the dtype grid beside upstream, then validate)"
      exit 0
    fi
    [[ $# -ge 1 && $1 == *.whl ]] || { echo "usage: $0 record WHEEL [BENCH ARGS]" >&2; exit 2; }
    wheel=$1
    shift
    status=0
    # (the bench step names the wheel's own commit, from its manifest)
    echo "== record of $wheel: the dtype grid beside upstream"
    "$PY" -m ci.pipeline bench --wheel "$wheel" --grid dtype --impls kernel,upstream,upstream-score \
      --compile none --no-host-overhead --no-decode-step "$@" || status=1
    echo "== record of $wheel: validate (provenance, tests/gpu, sanitizers, timing)"
    "$PY" -m ci.pipeline kernels --wheel "$wheel" || status=1
    exit "$status" ;;
  ab)
    if [[ ${1:-} == -h || ${1:-} == --help ]]; then
      echo "usage: $0 ab OUTDIR CASES BUILDS [TIME ARGS] (scripts/v2_harness.py --help: CASES,"
      echo "BUILDS, TIME ARGS; the build 'upstream' is vLLM's scoring kernel, needs .upstream)"
      exit 0
    fi
    [[ $# -ge 3 ]] || { echo "usage: $0 ab OUTDIR CASES BUILDS [TIME ARGS]" >&2; exit 2; }
    out=$1 cases=$2 builds=$3
    shift 3
    status=0
    # one process per candidate (--alts), each beside this tree's build (new): a fault in
    # one candidate stops only its own checks and timings
    for b in ${builds//,/ }; do
      [[ $b == new || $b == old ]] && continue
      o="$out/$b"
      mkdir -p "$o"
      if [[ $b == upstream ]]; then  # vLLM's scoring kernel on the same tensors, beside new
        echo "== upstream: ncu, $cases (its scoring alone: top-k not run; selection cases)"
        ncu --csv --metrics gpu__time_duration.sum -k "regex:select_kernel|qsa_mqa" \
          "$PY" scripts/v2_harness.py --once "$cases" --once-lib "new,upstream" \
          > "$o/ab.log" 2>&1 || status=1
        "$PY" scripts/v2_harness.py --ab-report "$o/ab.log" | tee "$o/ab.txt" || status=1
        continue
      fi
      echo "== $b: checks (against float64 / bit-exact, beside new and the seed's build)"
      "$PY" scripts/v2_harness.py --check --alts "$b" --out "$o" > "$o/check.log" 2>&1 || status=1
      grep -E "^(checks:|FAIL)" "$o/check.log" | head -20 || true
      echo "== $b: ncu, $cases"
      ncu --csv --metrics gpu__time_duration.sum -k "regex:attention|select_kernel" \
        "$PY" scripts/v2_harness.py --once "$cases" --once-lib "new,$b" --alts "$b" \
        > "$o/ab.log" 2>&1 || status=1
      "$PY" scripts/v2_harness.py --ab-report "$o/ab.log" | tee "$o/ab.txt" || status=1
      if [[ $# -gt 0 ]]; then
        echo "== $b: graph replay: $*"
        "$PY" scripts/v2_harness.py --time --alts "$b" --out "$o" "$@" > "$o/time.log" 2>&1 ||
          status=1
        grep -E "( new | $b )" "$o/time.log" || true
      fi
    done
    exit "$status" ;;
  -h|--help)
    usage
    echo "(validate --help, bench --help: the step's own arguments)" ;;
  *)
    usage >&2
    exit 2 ;;
esac
