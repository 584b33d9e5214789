#!/usr/bin/env bash
# Builds the development shims of scripts/v2_harness.py (CPU machine; nvcc on PATH):
#   .harness/libqsa_new.so   this tree's csrc/qsa kernels
#   .harness/libqsa_old.so   the kernels of BASE (default: the last commit before contract v2's
#                            kernels, given as $1), with the seed's interface
# Flags: the cuda-sm90 target's (build_targets.py).
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-HEAD}
out=.harness
mkdir -p "$out/old"
flags=(-gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr
       -Xcompiler=-fPIC -Xcompiler=-fvisibility=default -DNDEBUG -shared)
for f in common.cuh qsa.h contract.h select_paged_tokens.cu sparse_paged_attention.cu; do
  git show "$base:csrc/qsa/$f" > "$out/old/$f"
done
nvcc "${flags[@]}" -Icsrc/qsa -DQSA_SHIM_V2 scripts/v2_shim.cu csrc/qsa/select_paged_tokens.cu \
  csrc/qsa/sparse_paged_attention.cu -o "$out/libqsa_new.so" &
nvcc "${flags[@]}" -I"$out/old" scripts/v2_shim.cu "$out/old/select_paged_tokens.cu" \
  "$out/old/sparse_paged_attention.cu" -o "$out/libqsa_old.so" &
# a candidate variant of this tree (a macro of csrc/qsa), timed beside it (QSA_ALT_FLAGS)
nvcc "${flags[@]}" -Icsrc/qsa -DQSA_SHIM_V2 ${QSA_ALT_FLAGS:--DQSA_ATTN_FLAT=1} scripts/v2_shim.cu \
  csrc/qsa/select_paged_tokens.cu csrc/qsa/sparse_paged_attention.cu -o "$out/libqsa_alt.so" &
wait %1 && wait %2 && wait %3
ls -la "$out"/*.so
