#!/usr/bin/env bash
# Builds the development shims of scripts/v2_harness.py (CPU machine; nvcc on PATH):
#   .harness/libqsa_new.so   this tree's csrc/qsa kernels
#   .harness/libqsa_old.so   the kernels of BASE (default: the last commit before contract v2's
#                            kernels, given as $1), with the seed's interface
#   .harness/libqsa_alt_NAME.so  this tree built with extra flags, one per QSA_ALT entry
#                            "NAME=FLAGS;NAME=FLAGS" (default: the per-lane float8 attention and
#                            two float8 key chunks, i.e. v30: d2=-DQSA_ATTN_MMA=0
#                            -DQSA_SELECT_FP8_DEPTH=2), timed beside it; "NAME=@REF FLAGS"
#                            builds the kernels of git ref REF instead of this tree's
# Flags: the cuda-sm90 target's (build_targets.py).
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-HEAD}
out=.harness
mkdir -p "$out/old"
# -fno-gnu-unique: the builds share one process, and with default visibility an inline
# function's static (e.g. a launch's once-per-device opt-in) would be one STB_GNU_UNIQUE object
# for all of them, so a second build would take the first one's as its own.
flags=(-gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr
       -Xcompiler=-fPIC -Xcompiler=-fvisibility=default -Xcompiler=-fno-gnu-unique -DNDEBUG
       -shared)
for f in common.cuh qsa.h contract.h select_paged_tokens.cu sparse_paged_attention.cu; do
  git show "$base:csrc/qsa/$f" > "$out/old/$f"
done
nvcc "${flags[@]}" -Icsrc/qsa -DQSA_SHIM_V2 scripts/v2_shim.cu csrc/qsa/select_paged_tokens.cu \
  csrc/qsa/sparse_paged_attention.cu -o "$out/libqsa_new.so" &
pids=($!)
nvcc "${flags[@]}" -I"$out/old" scripts/v2_shim.cu "$out/old/select_paged_tokens.cu" \
  "$out/old/sparse_paged_attention.cu" -o "$out/libqsa_old.so" &
pids+=($!)
rm -f "$out"/libqsa_alt*.so
IFS=';' read -ra alts <<< "${QSA_ALT:-d2=-DQSA_ATTN_MMA=0 -DQSA_SELECT_FP8_DEPTH=2}"
for entry in "${alts[@]}"; do
  [[ -n "$entry" ]] || continue
  name=${entry%%=*} extra=${entry#*=} src=csrc/qsa
  if [[ $extra == @* ]]; then  # @REF [FLAGS]: the kernels of git ref REF (e.g. a candidate branch)
    ref=${extra%% *} src="$out/src_$name"
    [[ $extra == *" "* ]] && extra=${extra#* } || extra=""
    mkdir -p "$src"
    for f in common.cuh qsa.h contract.h select_paged_tokens.cu sparse_paged_attention.cu; do
      git show "${ref#@}:csrc/qsa/$f" > "$src/$f"
    done
  fi
  # shellcheck disable=SC2086
  nvcc "${flags[@]}" -I"$src" -DQSA_SHIM_V2 $extra scripts/v2_shim.cu \
    "$src/select_paged_tokens.cu" "$src/sparse_paged_attention.cu" \
    -o "$out/libqsa_alt_${name}.so" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done  # a failed build fails the script
ls -la "$out"/*.so
