// Sparse paged attention over a paged K/V cache (contract section 2, v2).
//
// One kernel family for every layout and dtype: templated on the element type of q/out/gate
// (QT: __half or __nv_bfloat16) and of the caches (KT: QT or __nv_fp8_e4m3), taking the
// caches' page and token strides and the page size at run time (K and V each a pointer and
// two strides: one storage, packed K then V, or two; any page stride, e.g. vLLM's layouts
// whose page stride spans the other layers). fp8: k_scale is folded into the softmax scale and
// v_scale into the output. The optional output gate is applied where the output is written.
//
// One launch, one of two kernels.
//
// Decode-size batches (at most 8 rows, when the whole grid fits on the device at once): the
// small kernel below, 33 or 65 CTAs per row of one DRAM round trip each, merged by waiting
// CTAs of the same grid (see attention_small_kernel).
//
// Otherwise the cluster kernel: grid (R, splits): CTA (r, s) takes the balanced column range
// [s*2051/splits, (s+1)*2051/splits) of row r, resolves it to cache slots (holes and
// out-of-table entries dropped, duplicates kept) and runs an online softmax over it. Each
// token is 1 KiB (256 K halves then 256 V halves): a warp reads it with one 16-byte load per
// lane for K and one for V, once for all 3 heads.
// Split rows (splits > 1) run as thread-block clusters of up to 8 CTAs: the CTAs of a cluster
// merge their partials through distributed shared memory in rank order, each CTA producing
// one slice of the 768 outputs. With more than 8 splits (several clusters per row), each
// slice is published to the workspace and the last cluster to arrive for that slice (a
// counter per (row, slice), acquire/release, reset by that CTA) merges the clusters' slices
// in cluster order, so the result never depends on which CTA finishes last.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "qsa.h"

// The float8 K/V loop on tensor cores (v31); 0 builds the per-lane loop for every dtype.
#ifndef QSA_ATTN_MMA
#define QSA_ATTN_MMA 1
#endif
// 1 builds one 32-bit offset per token where K and V share their strides (2-byte caches
// measured faster: ncu, H100, R = 64 0.94-0.95x the time, R = 8 and 256 0.97-0.99x; NOTES
// v32, v38); 0 the (page, slot) pair only.
// Independent accumulator chains of the float8 loop's QK^T (v33: 1, 2 or 4).
#ifndef QSA_ATTN_QK_CHAINS
#define QSA_ATTN_QK_CHAINS 2
#endif
#ifndef QSA_ATTN_FLAT
#define QSA_ATTN_FLAT 1
#endif

namespace qsa {
// NOTES: a named namespace, not an anonymous one: nvcc names anonymous-namespace kernels
// after a hash of the source's absolute path, which would make the DSO depend on where it
// was built.
namespace attention_impl {

namespace cg = cooperative_groups;
using detail::atomic_add_acq_rel_gpu;
using detail::Elem;
using detail::fp8x4_to_half4;
using detail::ldg32_pred;
using detail::mma_16816;
using detail::word;

constexpr int kHeads = QSA_ATTN_HEADS;     // 3
constexpr int kHeadDim = QSA_HEAD_DIM;     // 256
constexpr int kWidth = QSA_WIDTH;          // 2051
static_assert(kHeadDim == 32 * 8, "a warp of 32 lanes x 8 elements covers one head vector");
static_assert(kHeads == 3, "partials are laid out for 3 heads");

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// NOTES: 5 tokens per warp pass fill 15 of the transposed butterfly's 16 values (4 used 12):
// 10 16-byte loads per lane in flight, a 40-token pass per CTA. fp8 caches: 10 tokens per
// pass (two butterflies), so that the bytes in flight per lane stay 160 (20 8-byte loads).
template <typename KT>
constexpr int tokens_per_warp() {
  return Elem<KT>::kBytes == 2 ? 5 : 10;
}
constexpr int kOut = kHeads * kHeadDim;             // 768 outputs per row
constexpr int kPartStride = kOut + 8;               // floats: 768 acc, 3 max, 3 sum, 2 pad
constexpr int kMaxCluster = 8;                      // portable cluster size
constexpr int kMaxClusters = 16;                    // clusters per row
constexpr int kMaxSplits = kMaxCluster * kMaxClusters;
constexpr int kCounterSlots = 4096;                 // one per (row, slice) when clusters > 1
// Resolve rounds per warp: each warp owns ceil(columns / 256) * 32 columns of its CTA.
constexpr int kMaxRounds = (kWidth + kThreads - 1) / kThreads;
constexpr int kSlotCap = kWarps * kMaxRounds * 32;
constexpr float kLog2e = 1.4426950408889634f;
// A stage of the float8 loop (16 tokens x (K + V) x 256 bytes, in uint4) and the dynamic
// shared memory of its CTA (two stages per warp).
constexpr int kPipeStage = 16 * 2 * 256 / 16;
constexpr int kPipeBytes = kWarps * 2 * kPipeStage * 16;
static_assert(kThreads == kHeadDim, "the CTA merge gives each thread one dim of every head");

// Division by the page size (runtime): i / d = (i * mul) >> shift for 0 <= i < 2^31
// (Granlund-Montgomery: shift = 31 + ceil(log2 d), mul = floor(2^shift / d) + 1 < 2^33).
struct PageDiv {
  uint64_t mul;
  uint32_t shift;
  uint32_t d;
  int64_t vdelta;  // kFlat: bytes from a token's K to its V (same strides)
  __device__ __forceinline__ uint32_t div(uint32_t i) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(i) * mul) >> shift);
  }
};
inline PageDiv make_page_div(int64_t d) {
  uint32_t l = 0;
  while ((int64_t(1) << l) < d) ++l;
  PageDiv pd;
  pd.shift = 31 + l;
  pd.mul = static_cast<uint64_t>(((unsigned __int128)1 << pd.shift) / uint64_t(d)) + 1;
  pd.d = static_cast<uint32_t>(d);
  return pd;
}

// A token's place in the caches: (physical page, slot in the page); page < 0: none.
struct TokenRef {
  int32_t page;
  int32_t slot;
};

// The epilogue: out = dtype(acc / l * v_scale), then, with a gate,
// dtype(float(that) * sigmoid(float(gate))). A row without any valid entry (l == 0) is zero.
template <typename QT>
__device__ __forceinline__ uint16_t finish_out(float acc, float l, float v_scale, bool gated,
                                               uint16_t gate_bits) {
  if (!(l > 0.f)) return Elem<QT>::from_float(0.f);
  float v = acc / l;
  if (v_scale != 1.f) v *= v_scale;
  uint16_t o = Elem<QT>::from_float(v);
  if (gated) {
    const float g = Elem<QT>::to_float(gate_bits);
    const float sig = 1.f / (1.f + expf(-g));
    o = Elem<QT>::from_float(Elem<QT>::to_float(o) * sig);
  }
  return o;
}

// A gate element, loaded before it is needed (coherent: among a kernel's first loads).
__device__ __forceinline__ uint16_t load_gate(const void* gate, int64_t o, bool pred) {
  return pred ? detail::ld16(static_cast<const unsigned short*>(gate) + o) : uint16_t(0);
}

// Sum each of 16 per-lane values over the warp; returns, in lane L, the sum of value L >> 1.
__device__ __forceinline__ float warp_reduce16(const float (&v)[16], int lane) {
  float a[8], c[4], e[2];
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4, b1 = lane & 2;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float keep = b4 ? v[i + 8] : v[i], send = b4 ? v[i] : v[i + 8];
    a[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float keep = b3 ? a[i + 4] : a[i], send = b3 ? a[i] : a[i + 4];
    c[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float keep = b2 ? c[i + 2] : c[i], send = b2 ? c[i] : c[i + 2];
    e[i] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
  }
  float f = (b1 ? e[1] : e[0]) + __shfl_xor_sync(0xffffffffu, b1 ? e[0] : e[1], 2);
  return f + __shfl_xor_sync(0xffffffffu, f, 1);
}

// Per-warp pieces of both kernels. Lane L covers dims [8 L, 8 L + 8) of every head.
// q is 2-byte (fp16/bf16): 16-byte loads where it is 16-byte aligned (vec16), else 2-byte.
__device__ __forceinline__ void load_q(const void* q_base, int64_t r, int lane, bool vec16,
                                       uint4 (&qraw)[kHeads]) {
  const __half* q = static_cast<const __half*>(q_base) + r * (kHeads * kHeadDim);
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    qraw[h] = detail::load8_first_any(q + h * kHeadDim + lane * 8, vec16, true);
  }
}

template <typename QT>
__device__ __forceinline__ void q_to_float(const uint4 (&qraw)[kHeads], float (&qf)[kHeads][8]) {
#pragma unroll
  for (int h = 0; h < kHeads; ++h) Elem<QT>::to_float8(qraw[h], qf[h]);
}

// This lane's 8 elements of a token's K or V (kv: the cache's base, already offset to the
// lane's dims; `off` in elements).
template <typename KT>
__device__ __forceinline__ typename Elem<KT>::Raw load_kv(const KT* base, int64_t off,
                                                          bool pred) {
  return detail::load_raw8<KT>(base + off, pred);
}

// This lane's partial dot products of one token's K with the 3 heads.
template <typename KT>
__device__ __forceinline__ void partial_dots(const float (&qf)[kHeads][8],
                                             const typename Elem<KT>::Raw& kraw,
                                             float (&dot)[kHeads]) {
  float kf[8];
  Elem<KT>::to_float8(kraw, kf);
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    float d0 = 0.f;
#pragma unroll
    for (int d = 0; d < 8; ++d) d0 = fmaf(qf[h][d], kf[d], d0);
    dot[h] = d0;
  }
}

// acc[h] += w[h] * V (this lane's 8 dims).
template <typename KT>
__device__ __forceinline__ void accumulate_v(const typename Elem<KT>::Raw& vraw,
                                             const float (&w)[kHeads], float (&acc)[kHeads][8]) {
  float vf[8];
  Elem<KT>::to_float8(vraw, vf);
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[h][d] = fmaf(w[h], vf[d], acc[h][d]);
  }
}

// The warp's unnormalised outputs and its max and sum per head, into shared memory.
__device__ __forceinline__ void publish_warp(const float (&acc)[kHeads][8],
                                             const float (&m)[kHeads], const float (&l)[kHeads],
                                             float* acc_row, float* m_row, float* l_row,
                                             int lane) {
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
#pragma unroll
    for (int d = 0; d < 8; d += 4) {
      *reinterpret_cast<float4*>(&acc_row[h * kHeadDim + lane * 8 + d]) =
          make_float4(acc[h][d], acc[h][d + 1], acc[h][d + 2], acc[h][d + 3]);
    }
    if (lane == 0) {
      m_row[h] = m[h];
      l_row[h] = l[h];
    }
  }
}

// ---- The float8 K/V loop on tensor cores (v31) ------------------------------------------
// NOTES (v31): with float8 K/V the per-lane loop above is instruction-bound (every element
// widened to float and multiplied by 3 heads on the FMA pipe: 68 % of the memory floor at
// R = 256, H100). The float8 path runs both products on mma.sync m16n8k16 (f16 in, f32
// accumulate), tokens as the M dimension (3 of the 8 N columns are heads, so 3/8 of the
// tensor work is used: still ~5 % of the memory time). K and V are widened exactly
// (cvt.rn.f16x2.e4m3x2); q is float16 as given, or (bfloat16) scaled per head by a power of
// two into [2^14, 2^15) and rounded to float16 (exact for every element >= amax * 2^-28: a
// bfloat16 has 8 significant bits, a float16 11), the power undone in the softmax scale.
// A warp takes 16 tokens per tile. Lane (g, c) = (lane / 4, lane % 4):
//  * QK^T: A = K rows (tokens g, g + 8), 64 dims per lane as 4 x 16 bytes at byte offsets
//    (4 i + c) * 16 (a token's 256 bytes in 4 loads of 4 lanes); B = q of head g at the same
//    dims (registers, loaded once). S: lane holds tokens g, g + 8 x heads 2c, 2c + 1.
//  * PV: O^T = V^T P^T, M = dims, K = tokens: lane reads tokens c, c + 8, c + 4, c + 12
//    (k = 2c, 2c + 1, 2c + 8, 2c + 9), dims (8 h + g) * 16 .. + 16 for h = 0, 1 (a token's
//    256 bytes in 2 loads of 8 lanes); two tokens' bytes of one dim are paired by prmt, then
//    widened. P^T comes from S by four shuffles (f16 pairs); acc: 16 m-tiles x 4 floats.
//  * Online softmax per head over the tile (max over the 8 lane groups by 3 shuffles), the
//    rescale of acc skipped when no head's max moved (warp vote).
// K and V of the next tile are issued after this tile's QK^T (v32; V after the PV before:
// ncu, H100, R = 256 0.97x the time, R = 8 and 64 unchanged), V double-buffered.
template <typename KT>
constexpr bool mma_path() {
#if QSA_ATTN_MMA
  return Elem<KT>::kBytes == 1;
#else
  return false;
#endif
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

struct AttnShared {
  TokenRef slots[kSlotCap];            // resolved cache slots (physical page, slot)
  int warp_count[kWarps];
  float acc[kWarps][kOut];             // per-warp unnormalised outputs
  float m[kWarps][kHeads];
  float l[kWarps][kHeads];
  union alignas(16) {
    float cta_acc[kOut];               // this CTA's partial, read by its cluster (DSMEM)
    uint16_t qh[kHeads][kHeadDim];     // float8 path: q as float16, read before the merge
  };
  float cta_m[kHeads];
  float cta_l[kHeads];
  int is_last;
};

// sm_90's opt-in limit of a CTA's shared memory (227 KiB): the float8 loop's stages beside
// the static part
static_assert(kPipeBytes + sizeof(AttnShared) <= 227 * 1024, "float8 stages fit one SM");

__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// grid (R, splits), clusters of `csize` CTAs along y (csize = 1 when splits == 1).
// kDeep: a grid of at most one CTA per SM; each warp has two passes in flight (the next
// pass's K/V loads go out before this pass's compute), in the registers that a second
// resident CTA would otherwise hold.
// QT: q/out/gate element type; KT: the caches' (QT or fp8-e4m3).
// kFlat: K and V have the same strides and every K byte offset / 16 fits 32 bits: the
// resolve phase stores each token's 16-byte offset (one word) and V is K + vdelta bytes.
template <typename QT, typename KT, bool kDeep, bool kFlat = false>
__global__ void __launch_bounds__(kThreads, kDeep || mma_path<KT>() ? 1 : 2)
    attention_kernel(AttentionParams p, PageDiv pdiv, int splits, int csize,
                     float* __restrict__ parts) {
  constexpr int kTokensPerWarp = tokens_per_warp<KT>();
  constexpr int kValues = kTokensPerWarp * kHeads;  // partial dots per lane and pass
  constexpr int kReduce = (kValues + 15) / 16;      // transposed butterflies per pass
  using Raw = typename Elem<KT>::Raw;
  __shared__ AttnShared sh;
  detail::grid_dependency_wait();  // before the first global access (a launch with pdl)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r = blockIdx.x;
  const int s = blockIdx.y;
  const bool gated = p.gate != nullptr;

  // ---- Everything that does not depend on a load is issued first ------------------------
  // q (3 x 16 B per lane), token_to_req and this warp's index columns go out together; the
  // page-table reads follow in one batch; then the K/V of the first pass.
  uint4 qraw[kHeads];
  load_q(p.q, r, lane, detail::aligned16(p.q), qraw);
  const int64_t b = ldg32_pred<detail::kFirst>(p.token_to_req + r, true, -1);
  // The gate elements this thread writes (splits == 1: dim tid of each head; else its
  // outputs of the cluster rank's slice), loaded now so that the epilogue does not wait.
  uint16_t gbits[kHeads];
  {
    const int csz = splits == 1 ? 1 : csize;
    const int rank = s % csz;
    const int o_lo = rank * kOut / csz, o_hi = (rank + 1) * kOut / csz;
#pragma unroll
    for (int u = 0; u < kHeads; ++u) {
      const int o = splits == 1 ? u * kHeadDim + tid : o_lo + tid + u * kThreads;
      gbits[u] = load_gate(p.gate, r * kOut + o, gated && o < o_hi);
    }
  }

  const int c_lo = static_cast<int>((int64_t(s) * kWidth) / splits);
  const int c_hi = static_cast<int>((int64_t(s + 1) * kWidth) / splits);
  const int rounds = (c_hi - c_lo + kThreads - 1) / kThreads;  // <= kMaxRounds
  const int seg = rounds * 32;
  const int seg_lo = c_lo + warp * seg;
  const int seg_hi = min(seg_lo + seg, c_hi);
  const int32_t* idx_row = p.logical_indices + r * p.indices_stride;
  int32_t li[kMaxRounds];
#pragma unroll
  for (int it = 0; it < kMaxRounds; ++it) {
    const int c = seg_lo + it * 32 + lane;
    li[it] = ldg32_pred<detail::kFirst>(idx_row + (c < seg_hi ? c : 0), it < rounds && c < seg_hi,
                                        -1);
  }
  const bool row_ok = b >= 0 && b < p.requests;
  const int32_t* table = p.page_table + (row_ok ? b : 0) * p.page_table_stride;
  int32_t ph[kMaxRounds], tok[kMaxRounds];
#pragma unroll
  for (int it = 0; it < kMaxRounds; ++it) {
    const int32_t i = li[it];
    const uint32_t lp = pdiv.div(static_cast<uint32_t>(i >= 0 ? i : 0));
    tok[it] = i - static_cast<int32_t>(lp * pdiv.d);
    const bool want = row_ok && i >= 0 && lp < p.table_width;
    ph[it] = ldg32_pred(table + (want ? lp : 0), want, -1);
  }
  // Warp w compacts the valid entries of its column segment, in column order, into its own
  // region sh.slots[w * seg ...]; token g of the CTA is then found through the warp bases.
  int count = 0;
  {
    const unsigned lt = (1u << lane) - 1u;
#pragma unroll
    for (int it = 0; it < kMaxRounds; ++it) {
      if (it < rounds) {  // warp-uniform
        const bool ok = ph[it] >= 0 && ph[it] < p.pages;
        const unsigned bits = __ballot_sync(0xffffffffu, ok);
        if (ok) {
          const int at = warp * seg + count + __popc(bits & lt);
          if constexpr (kFlat) {
            reinterpret_cast<uint32_t*>(sh.slots)[at] = static_cast<uint32_t>(
                ((int64_t(ph[it]) * p.k_page_stride + int64_t(tok[it]) * p.k_token_stride) *
                 int64_t(sizeof(KT))) >> 4);
          } else {
            sh.slots[at] = TokenRef{ph[it], tok[it]};
          }
        }
        count += __popc(bits);
      }
    }
  }
  // The float8 path's q, as float16 scaled per head (bfloat16: a power of two that brings the
  // head's largest |q| into [2^14, 2^15); float16: as given), for the tensor-core B operand.
  float q_unscale[kHeads];
  if constexpr (mma_path<KT>()) {
    float qs[kHeads][8];
    q_to_float<QT>(qraw, qs);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      int e = 0;
      if constexpr (Elem<QT>::kBytes == 2 && !std::is_same_v<QT, __half>) {
        float amax = 0.f;
#pragma unroll
        for (int d = 0; d < 8; ++d) amax = fmaxf(amax, fabsf(qs[h][d]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if (amax > 0.f && amax <= 3.0e38f) {
          int ex = 0;
          (void)frexpf(amax, &ex);  // amax in [2^(ex-1), 2^ex)
          e = min(max(15 - ex, -100), 100);
        }
      }
      q_unscale[h] = ldexpf(1.f, -e);
      if (warp == 0) {
        uint32_t w[4];
#pragma unroll
        for (int d = 0; d < 8; d += 2) {
          w[d / 2] = pack_half2(ldexpf(qs[h][d], e), ldexpf(qs[h][d + 1], e));
        }
        *reinterpret_cast<uint4*>(&sh.qh[h][lane * 8]) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
  if (lane == 0) sh.warp_count[warp] = count;
  __syncthreads();
  int base[kWarps + 1];  // exclusive prefix of the warp counts, in registers
  base[0] = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) base[w + 1] = base[w] + sh.warp_count[w];
  const int total = base[kWarps];
  // Token g lives at sh.slots[g + shift(g)], shift = w * seg - base[w] for its warp region w.
  auto slot_of = [&](int g) {
    int shift = 0;
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      if (g >= base[w]) shift = w * seg - base[w];
    }
    return sh.slots[g + shift];
  };
  auto flat_of = [&](int g) {
    int shift = 0;
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      if (g >= base[w]) shift = w * seg - base[w];
    }
    return reinterpret_cast<const uint32_t*>(sh.slots)[g + shift];
  };

  if constexpr (mma_path<KT>()) {
    // ---- float8 K/V on tensor cores: warp w takes tiles of 16 tokens w*16 + it*128 -------
    constexpr int kTile = 16;
    constexpr int kStep = kWarps * kTile;
    const int g = lane >> 2, c = lane & 3;
    const float base_scale = p.softmax_scale * p.k_scale * kLog2e;
    // this lane's two heads (2c, 2c + 1; heads >= 3 unused) and their score scales
    const float scl_e = c == 0 ? base_scale * q_unscale[0] : base_scale * q_unscale[2];
    const float scl_o = base_scale * q_unscale[1];
    // B operand of QK^T: q of head g at this lane's dims (4 i + c) * 16 + 4 w + {0..3}
    uint32_t qb[16][2];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int dim = (4 * (j / 4) + c) * 16 + 4 * (j % 4);
      const uint2 v = g < kHeads ? *reinterpret_cast<const uint2*>(&sh.qh[g < kHeads ? g : 0][dim])
                                 : make_uint2(0u, 0u);
      qb[j][0] = v.x;
      qb[j][1] = v.y;
    }
    float acc[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_e = -INFINITY, m_o = -INFINITY, l_e = 0.f, l_o = 0.f;
    const char* kb = static_cast<const char*>(p.k_cache);
    const char* vb = static_cast<const char*>(p.v_cache);
    // Byte offsets of tile token `lane` (lanes < 16), for the shuffles below. NOTES (v35
    // candidate): a token past the CTA's last one takes that token's place (g0 < total), so
    // that every K/V load is unpredicated (no zeroed registers, no predicate per load): its
    // score is masked to -inf and its P is 0, and the V it reads is a real token's (finite).
    auto offsets = [&](int g0, int64_t& ko, int64_t& vo) {
      const TokenRef ref = slot_of(min(g0 + lane, total - 1));
      ko = int64_t(ref.page) * p.k_page_stride + int64_t(ref.slot) * p.k_token_stride;
      vo = int64_t(ref.page) * p.v_page_stride + int64_t(ref.slot) * p.v_token_stride;
    };
    auto shfl64 = [](int64_t v, int src) {
      const uint32_t lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(v), src);
      const uint32_t hi = __shfl_sync(0xffffffffu, static_cast<uint32_t>(uint64_t(v) >> 32), src);
      return static_cast<int64_t>((uint64_t(hi) << 32) | lo);
    };
    // NOTES (v50): each warp keeps two 16-token tiles of K|V in flight in shared memory
    // (cp.async, no registers held for them): tile j + 2 goes out when tile j is read into
    // registers, so a load has two tiles of compute to arrive instead of one (v31-v48: the
    // loop with one tile in flight in registers ran at 1.2-1.3x the rows' read floor).
    // A stage: K then V of 16 tokens, each row 16 chunks of 16 bytes, the chunks swizzled so
    // that the fragment reads below are free of bank conflicts (K: row parity flips the
    // half of the 128-byte line; V: the row's low two bits shift the chunk).
    extern __shared__ uint4 pipe_smem[];
    uint4* const st0 = pipe_smem + warp * (2 * kPipeStage);
    uint4* const st1 = st0 + kPipeStage;
    auto k_at = [](int row, int ch) { return row * 16 + (ch ^ ((row & 1) << 2)); };
    auto v_at = [](int row, int ch) { return 256 + row * 16 + (ch ^ ((row & 3) << 1)); };
    auto issue_tile = [&](int g0, uint4* st) {
      int64_t ko, vo;
      offsets(g0, ko, vo);
      // 8 lanes a half row (128 contiguous bytes), four tokens an instruction: the 8 lanes of
      // each shared-memory phase write 8 different bank groups
      const int tq = lane >> 3, ch = lane & 7;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int t = tq + 4 * u;
        const char* ks = kb + shfl64(ko, t) + ch * 16;
        const char* vs = vb + shfl64(vo, t) + ch * 16;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          detail::cp_async16(st + k_at(t, ch + 8 * h), ks + h * 128);
          detail::cp_async16(st + v_at(t, ch + 8 * h), vs + h * 128);
        }
      }
    };
    // this lane's mma fragments: K tokens g, g + 8 at chunks c + 4 j (QK^T's A operand); V
    // tokens c, c + 8, c + 4, c + 12 at chunks g, g + 8 (PV's A operand, bytes permuted below)
    auto read_tile = [&](const uint4* st, uint4 (&kr)[8], uint4 (&vr)[8]) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        kr[j] = st[k_at(g, c + 4 * j)];
        kr[4 + j] = st[k_at(g + 8, c + 4 * j)];
      }
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int tt = c + (t == 1 ? 8 : t == 2 ? 4 : t == 3 ? 12 : 0);
        vr[2 * t] = st[v_at(tt, g)];
        vr[2 * t + 1] = st[v_at(tt, g + 8)];
      }
    };
    auto tile = [&](int g0, const uint4 (&kr)[8], const uint4 (&vr)[8]) {
      // S = K q^T: tokens g, g + 8 x heads 2c, 2c + 1
      // NOTES (v33): QSA_ATTN_QK_CHAINS independent accumulators (k-steps j, j +
      // chains, ...), summed after: one chain made the 16 mma of QK^T wait on each other
      // (SASS of v31: one accumulator register set through all 16 HMMA).
      constexpr int kChains = QSA_ATTN_QK_CHAINS;
      float sq[kChains][4];
      detail::zero_chains(sq);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const uint32_t ka = word(kr[j / 4], j % 4), kb2 = word(kr[4 + j / 4], j % 4);
        const uint2 ha = fp8x4_to_half4(ka), hb = fp8x4_to_half4(kb2);
        mma_16816<false>(sq[j % kChains], ha.x, hb.x, ha.y, hb.y, qb[j][0],
                         qb[j][1]);
      }
      float sc[4];
      detail::sum_chains(sq, sc);
      const bool va = g0 + g < total, vb8 = g0 + g + 8 < total;
      const float s0 = va ? sc[0] * scl_e : -INFINITY, s1 = va ? sc[1] * scl_o : -INFINITY;
      const float s2 = vb8 ? sc[2] * scl_e : -INFINITY, s3 = vb8 ? sc[3] * scl_o : -INFINITY;
      float mx_e = fmaxf(s0, s2), mx_o = fmaxf(s1, s3);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        mx_e = fmaxf(mx_e, __shfl_xor_sync(0xffffffffu, mx_e, o));
        mx_o = fmaxf(mx_o, __shfl_xor_sync(0xffffffffu, mx_o, o));
      }
      const float mn_e = fmaxf(m_e, mx_e), mn_o = fmaxf(m_o, mx_o);
      const float al_e = exp2f(m_e - mn_e), al_o = exp2f(m_o - mn_o);  // m = -inf: 0
      m_e = mn_e;
      m_o = mn_o;
      const float p0 = exp2f(s0 - mn_e), p1 = exp2f(s1 - mn_o);
      const float p2 = exp2f(s2 - mn_e), p3 = exp2f(s3 - mn_o);
      l_e = l_e * al_e + (p0 + p2);
      l_o = l_o * al_o + (p1 + p3);
      if (__any_sync(0xffffffffu, al_e != 1.f || al_o != 1.f)) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          acc[i][0] *= al_e;
          acc[i][1] *= al_o;
          acc[i][2] *= al_e;
          acc[i][3] *= al_o;
        }
      }
      // P^T as the B operand: (P[head g][token c], P[g][c + 8]) and (P[g][c + 4], P[g][c + 12]),
      // held by lanes 4 c + g / 2 and 4 (c + 4) + g / 2 (S rows c, c + 8 / c + 4, c + 12).
      const uint32_t pe = pack_half2(p0, p2), po = pack_half2(p1, p3);
      const int src_a = 4 * c + (g >> 1), src_b = 4 * (c + 4) + (g >> 1);
      const uint32_t xa = __shfl_sync(0xffffffffu, pe, src_a);
      const uint32_t xo = __shfl_sync(0xffffffffu, po, src_a);
      const uint32_t ya = __shfl_sync(0xffffffffu, pe, src_b);
      const uint32_t yo = __shfl_sync(0xffffffffu, po, src_b);
      const uint32_t pb0 = g < kHeads ? ((g & 1) ? xo : xa) : 0u;
      const uint32_t pb1 = g < kHeads ? ((g & 1) ? yo : ya) : 0u;
      // O^T += V^T P^T: m-tile i covers dims (8 (i / 8) + g) * 16 + 4 ((i % 8) / 2) + 2 (i % 2)
      // (row g) and + 1 (row g + 8)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const uint32_t x0 = word(vr[h], w), x1 = word(vr[2 + h], w);
          const uint32_t x2 = word(vr[4 + h], w), x3 = word(vr[6 + h], w);
          const uint32_t lo01 = __byte_perm(x0, x1, 0x5140), hi01 = __byte_perm(x0, x1, 0x7362);
          const uint32_t lo23 = __byte_perm(x2, x3, 0x5140), hi23 = __byte_perm(x2, x3, 0x7362);
          const int i = h * 8 + w * 2;
          const uint2 l01 = fp8x4_to_half4(lo01), l23 = fp8x4_to_half4(lo23);
          const uint2 h01 = fp8x4_to_half4(hi01), h23 = fp8x4_to_half4(hi23);
          mma_16816<false>(acc[i], l01.x, l01.y, l23.x, l23.y, pb0, pb1);
          mma_16816<false>(acc[i + 1], h01.x, h01.y, h23.x, h23.y, pb0, pb1);
        }
      }
    };
    int g0 = warp * kTile;
    if (g0 < total) issue_tile(g0, st0);
    detail::cp_async_commit();
    if (g0 + kStep < total) issue_tile(g0 + kStep, st1);
    detail::cp_async_commit();
    for (int j = 0; g0 < total; g0 += kStep, ++j) {
      uint4* const st = (j & 1) ? st1 : st0;
      detail::cp_async_wait<1>();  // all but the newest group: tile j has landed
      __syncwarp();
      uint4 kr[8], vr[8];
      read_tile(st, kr, vr);
      __syncwarp();  // every lane's reads of the stage before it is refilled
      if (g0 + 2 * kStep < total) issue_tile(g0 + 2 * kStep, st);
      detail::cp_async_commit();  // (empty past the last tile: the count stays uniform)
      tile(g0, kr, vr);
    }
    detail::cp_async_wait<0>();
    // ---- Merge the warps of this CTA (fixed order) ---------------------------------------
    detail::allow_dependents();  // every K/V line read: the next kernel may take the SMs left
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      l_e += __shfl_xor_sync(0xffffffffu, l_e, o);
      l_o += __shfl_xor_sync(0xffffffffu, l_o, o);
    }
    if (c < 2) {
      float* acc_row = sh.acc[warp];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int dim = (8 * (i / 8) + g) * 16 + 4 * ((i % 8) / 2) + 2 * (i % 2);
        *reinterpret_cast<float2*>(&acc_row[(2 * c) * kHeadDim + dim]) =
            make_float2(acc[i][0], acc[i][2]);
        if (c == 0) {
          *reinterpret_cast<float2*>(&acc_row[kHeadDim + dim]) = make_float2(acc[i][1], acc[i][3]);
        }
      }
      if (g == 0) {
        sh.m[warp][2 * c] = m_e;
        sh.l[warp][2 * c] = l_e;
        if (c == 0) {
          sh.m[warp][1] = m_o;
          sh.l[warp][1] = l_o;
        }
      }
    }
  } else {
  // ---- Online softmax: warp w takes tokens it*40 + w*5 + t --------------------------------
  // Lane covers dims [8 lane, 8 lane + 8) of every head.
  float qf[kHeads][8];
  q_to_float<QT>(qraw, qf);
  // fp8: k_scale folded into the softmax scale (1 otherwise: the same float).
  const float scale_log2 = p.softmax_scale * p.k_scale * kLog2e;
  float m[kHeads], l[kHeads], acc[kHeads][8];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[h][d] = 0.f;
  }
  const KT* kbase = static_cast<const KT*>(p.k_cache) + lane * 8;
  const KT* vbase = static_cast<const KT*>(p.v_cache) + lane * 8;
  const char* kbytes = static_cast<const char*>(p.k_cache) + lane * 8 * sizeof(KT);
  auto issue = [&](int g0, Raw(&kr)[kTokensPerWarp], Raw(&vr)[kTokensPerWarp]) {
    if constexpr (kFlat) {
      uint32_t off[kTokensPerWarp];
      if constexpr (kDeep) {
        const uint32_t own = lane < kTokensPerWarp && g0 + lane < total ? flat_of(g0 + lane) : 0u;
#pragma unroll
        for (int t = 0; t < kTokensPerWarp; ++t) off[t] = __shfl_sync(0xffffffffu, own, t);
      } else {
#pragma unroll
        for (int t = 0; t < kTokensPerWarp; ++t) off[t] = g0 + t < total ? flat_of(g0 + t) : 0u;
      }
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) {
        const char* kt = kbytes + (static_cast<uint64_t>(off[t]) << 4);
        kr[t] = detail::load_raw8<KT>(reinterpret_cast<const KT*>(kt), g0 + t < total);
        vr[t] = detail::load_raw8<KT>(reinterpret_cast<const KT*>(kt + pdiv.vdelta),
                                      g0 + t < total);
      }
      return;
    }
    TokenRef ref[kTokensPerWarp];
    if constexpr (kDeep) {
      // NOTES (v28b): one CTA per SM: lane t < kTokensPerWarp finds token g0 + t's slot and
      // the warp takes them by shuffles (one lookup per lane instead of kTokensPerWarp);
      // measured faster there (H100, R = 64: fp16 63.5 -> 62.2 us, fp8 50.2 -> 46.3) and
      // slower at two CTAs per SM (R = 256: fp8 137 -> 143, 32 bytes of spills).
      const TokenRef own =
          lane < kTokensPerWarp && g0 + lane < total ? slot_of(g0 + lane) : TokenRef{0, 0};
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) {
        ref[t].page = __shfl_sync(0xffffffffu, own.page, t);
        ref[t].slot = __shfl_sync(0xffffffffu, own.slot, t);
      }
    } else {
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) {
        ref[t] = g0 + t < total ? slot_of(g0 + t) : TokenRef{0, 0};
      }
    }
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
      const int64_t koff = int64_t(ref[t].page) * p.k_page_stride +
                           int64_t(ref[t].slot) * p.k_token_stride;
      const int64_t voff = int64_t(ref[t].page) * p.v_page_stride +
                           int64_t(ref[t].slot) * p.v_token_stride;
      kr[t] = load_kv<KT>(kbase, koff, g0 + t < total);
      vr[t] = load_kv<KT>(vbase, voff, g0 + t < total);
    }
  };
  constexpr int kPass = kWarps * kTokensPerWarp;
  Raw kraw[kTokensPerWarp], vraw[kTokensPerWarp];
  if (kDeep && warp * kTokensPerWarp < total) issue(warp * kTokensPerWarp, kraw, vraw);
  for (int g0 = warp * kTokensPerWarp; g0 < total; g0 += kPass) {
    Raw knext[kTokensPerWarp], vnext[kTokensPerWarp];
    if (kDeep) {
      if (g0 + kPass < total) issue(g0 + kPass, knext, vnext);
    } else {
      issue(g0, kraw, vraw);
    }
    // Partial dots of this lane's 8 dims: value v = t * 3 + h (15 of 16; 15 stays 0).
    float part[kReduce][16];
#pragma unroll
    for (int v = 0; v < kReduce * 16; ++v) part[v / 16][v % 16] = 0.f;
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
      float dot[kHeads];
      partial_dots<KT>(qf, kraw[t], dot);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        part[(t * kHeads + h) / 16][(t * kHeads + h) % 16] = dot[h];
      }
    }
    // NOTES: transposed butterfly: 16 values over 32 lanes in 8+4+2+1+1 = 16 shuffles (15
    // independent warp_sums would take 75, in chains of 5); lane L ends with the full sum of
    // value L >> 1, then 15 broadcasts hand every lane all scores.
    float full[kReduce];
#pragma unroll
    for (int u = 0; u < kReduce; ++u) full[u] = warp_reduce16(part[u], lane);
    float sc[kTokensPerWarp][kHeads];
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const int v = t * kHeads + h;
        const float dot = __shfl_sync(0xffffffffu, full[v / 16], 2 * (v % 16));
        sc[t][h] = (g0 + t < total) ? dot * scale_log2 : -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      float m_new = m[h];
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) m_new = fmaxf(m_new, sc[t][h]);
      const float alpha = exp2f(m[h] - m_new);  // m = -inf the first time: alpha = 0
      float psum = 0.f;
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) psum += exp2f(sc[t][h] - m_new);  // pad: 0
      l[h] = l[h] * alpha + psum;
      m[h] = m_new;
#pragma unroll
      for (int d = 0; d < 8; ++d) acc[h][d] *= alpha;
    }
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
      float w[kHeads];
#pragma unroll
      for (int h = 0; h < kHeads; ++h) w[h] = exp2f(sc[t][h] - m[h]);
      accumulate_v<KT>(vraw[t], w, acc);
    }
    if (kDeep) {
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) {
        kraw[t] = knext[t];
        vraw[t] = vnext[t];
      }
    }
  }

  // ---- Merge the warps of this CTA (fixed order) -----------------------------------------
  detail::allow_dependents();  // every K/V line read: the next kernel may take the SMs left
  publish_warp(acc, m, l, sh.acc[warp], sh.m[warp], sh.l[warp], lane);
  }
  __syncthreads();
  // Thread tid owns outputs o = tid + k*256 (k = head): head k, dim tid.
  float cta_m[kHeads], cta_l[kHeads], cta_acc[kHeads];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, sh.m[w][h]);
    float ll = 0.f, aa = 0.f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(sh.m[w][h] - mm);
        ll += sh.l[w][h] * f;
        aa += sh.acc[w][h * kHeadDim + tid] * f;
      }
    }
    cta_m[h] = mm;
    cta_l[h] = ll;
    cta_acc[h] = aa;
  }

  uint16_t* out = static_cast<uint16_t*>(p.out) + r * kOut;
  if (splits == 1) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      out[h * kHeadDim + tid] = finish_out<QT>(cta_acc[h], cta_l[h], p.v_scale, gated, gbits[h]);
    }
    return;
  }

  // ---- Cluster merge through distributed shared memory (rank order) -----------------------
  // CTA of rank k merges outputs [k*768/csize, (k+1)*768/csize) over the cluster's CTAs.
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    sh.cta_acc[h * kHeadDim + tid] = cta_acc[h];
    if (tid == h) {
      sh.cta_m[h] = cta_m[h];
      sh.cta_l[h] = cta_l[h];
    }
  }
  cluster_arrive_release();
  cluster_wait_acquire();
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = s % csize;
  const int cidx = s / csize;
  const int nclusters = splits / csize;
  const int o_lo = rank * kOut / csize;
  const int o_hi = (rank + 1) * kOut / csize;
  constexpr int kSlice = (kOut + 1) / 2;  // csize >= 2: at most 384 outputs per CTA
  constexpr int kPer = (kSlice + kThreads - 1) / kThreads;
  static_assert(kPer <= kHeads, "the preloaded gate elements cover the slice");
  float mo[kPer], lo[kPer], ao[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int o = o_lo + tid + u * kThreads;
    mo[u] = -INFINITY;
    lo[u] = 0.f;
    ao[u] = 0.f;
    if (o < o_hi) {
      const int h = o / kHeadDim;
      float mk[kMaxCluster];
#pragma unroll
      for (int k = 0; k < kMaxCluster; ++k) {
        mk[k] = k < csize ? *cluster.map_shared_rank(&sh.cta_m[h], k) : -INFINITY;
        mo[u] = fmaxf(mo[u], mk[k]);
      }
      if (mo[u] != -INFINITY) {
#pragma unroll
        for (int k = 0; k < kMaxCluster; ++k) {
          if (k < csize) {
            const float f = exp2f(mk[k] - mo[u]);
            lo[u] += *cluster.map_shared_rank(&sh.cta_l[h], k) * f;
            ao[u] += *cluster.map_shared_rank(&sh.cta_acc[o], k) * f;
          }
        }
      }
    }
  }
  cluster_arrive_release();  // done with the other CTAs' shared memory

  if (nclusters == 1) {
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int o = o_lo + tid + u * kThreads;
      if (o < o_hi) out[o] = finish_out<QT>(ao[u], lo[u], p.v_scale, gated, gbits[u]);
    }
  } else {
    // ---- Several clusters: publish the slice; the last cluster for it merges ------------
    float* part = parts + (r * nclusters + cidx) * kPartStride;
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int o = o_lo + tid + u * kThreads;
      if (o < o_hi) {
        part[o] = ao[u];
        if (o == o_lo || o % kHeadDim == 0) {  // one writer per (slice, head)
          part[kOut + o / kHeadDim] = mo[u];
          part[kOut + kHeads + o / kHeadDim] = lo[u];
        }
      }
    }
    __syncthreads();
    int32_t* counter = p.counters + r * csize + rank;
    if (tid == 0) sh.is_last = atomic_add_acq_rel_gpu(counter, 1) == nclusters - 1;
    __syncthreads();
    if (sh.is_last) {
      const float* row_parts = parts + r * nclusters * kPartStride;
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int o = o_lo + tid + u * kThreads;
        if (o < o_hi) {
          const int h = o / kHeadDim;
          float mm = -INFINITY;
          for (int c = 0; c < nclusters; ++c) {
            mm = fmaxf(mm, __ldcg(row_parts + c * kPartStride + kOut + h));
          }
          float ll = 0.f, aa = 0.f;
          if (mm != -INFINITY) {
#pragma unroll 4
            for (int c = 0; c < nclusters; ++c) {
              const float* pc = row_parts + c * kPartStride;
              const float f = exp2f(__ldcg(pc + kOut + h) - mm);
              ll += __ldcg(pc + kOut + kHeads + h) * f;
              aa += __ldcg(pc + o) * f;
            }
          }
          out[o] = finish_out<QT>(aa, ll, p.v_scale, gated, gbits[u]);
        }
      }
      if (tid == 0) *counter = 0;  // ready for the next call (and graph replay)
    }
  }
  cluster_wait_acquire();  // no CTA leaves while its shared memory may still be read
}

// ---- Decode-size rows: one round trip per CTA, partials merged by waiting CTAs ------------
// grid (splits, R), kW warps of kT tokens, launched cooperatively (so that every CTA is
// resident at once: the mergers below wait for the others). CTA s
// of row r takes the kW * kT columns [s * kW * kT, ...): warp w the kT columns w * kT + j,
// resolved by kT lanes and broadcast; all of the warp's K/V loads are issued before the
// first is used. Holes are masked, not compacted. The CTA merges its warps, writes its
// partial (unnormalised sums, max and sum per head) and releases it on the row counter;
// CTAs 0..mergers-1 then wait for the row's `splits` arrivals and each merges 32-output
// slices over all partials in split order (fixed, so the result does not depend on which CTA
// arrives last).
// NOTES (v20): the row counter is an epoch counter (detail::epoch_add, epoch_wait; epoch
// kSmallEpoch), never reset: a merger's arrival returns the value before it and waits for
// the one that completes its call. No merger has to count itself out again and reset the
// counter: one atomic round trip less.
// These counters have slots of their own, after the cluster kernel's (which start at zero).
constexpr int kMergeCols = 32;                          // outputs per merge slice
constexpr int kMergeSlices = kOut / kMergeCols;         // 24
constexpr int kCounterSpread = 32;  // row counters 128 bytes apart (no shared L2 sector)
constexpr int kSmallMaxRows = kCounterSlots / kCounterSpread;
constexpr int kSmallMinCols = 32;                       // the narrowest CTA: 8 warps x 4
constexpr int kSmallMaxSplits = (kWidth + kSmallMinCols - 1) / kSmallMinCols;  // 65
constexpr uint32_t kSmallEpoch = 128;                   // added to a row counter per call
static_assert(kHeadDim % kMergeCols == 0, "a merge slice lies in one head");
static_assert(kSmallMaxSplits <= int(kSmallEpoch), "every arrival of a call in one epoch");
static_assert((kSmallEpoch & (kSmallEpoch - 1)) == 0, "epochs divide 2^32");

template <int kW>
struct SmallShared {
  float acc[kW][kOut];
  float m[kW][kHeads];
  float l[kW][kHeads];
  float f[kW][kHeads];  // warp w's factor per head in the CTA merge
  float cm[kHeads];
  float cl[kHeads];
  float gm[kW][kMergeCols];
  float gl[kW][kMergeCols];
  float ga[kW][kMergeCols];
};

// kW warps of kT tokens each.
template <typename QT, typename KT, int kW, int kT, bool kFlat = false>
__global__ void __launch_bounds__(kW * 32, 128 / (kW * kT))
    attention_small_kernel(AttentionParams p, PageDiv pdiv, int splits, int mergers,
                           float* __restrict__ parts) {
  using Raw = typename Elem<KT>::Raw;
  constexpr int kThreadsS = kW * 32;
  constexpr int kCols = kW * kT;
  constexpr int kValues = kT * kHeads;           // partial dots per lane
  constexpr int kReduce = (kValues + 15) / 16;   // transposed butterflies
  constexpr int kGroupSplits = (kSmallMaxSplits + kW - 1) / kW;
  static_assert(kT <= 32 && kCols >= kSmallMinCols, "one resolving lane per column");
  __shared__ SmallShared<kW> sh;
  detail::grid_dependency_wait();  // before the first global access (a launch with pdl)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = blockIdx.x;
  const int64_t r = blockIdx.y;

  // Level 1: q, token_to_req and the warp's index columns together; level 2: the page-table
  // entries; level 3: every K/V line of the warp.
  uint4 qraw[kHeads];
  load_q(p.q, r, lane, detail::aligned16(p.q), qraw);
  const int64_t b = ldg32_pred<detail::kFirst>(p.token_to_req + r, true, -1);
  // The gate element this CTA's merge writes (a merger's first slice; see the merge).
  const bool gated = p.gate != nullptr;
  const uint16_t gbit0 =
      load_gate(p.gate, r * kOut + s * kMergeCols + tid, gated && s < mergers && tid < kMergeCols);
  const int col = s * kCols + warp * kT + lane;
  const bool have = lane < kT && col < kWidth;
  const int32_t li =
      ldg32_pred<detail::kFirst>(p.logical_indices + r * p.indices_stride + (have ? col : 0),
                                 have, -1);
  const bool row_ok = b >= 0 && b < p.requests;
  const int32_t* table = p.page_table + (row_ok ? b : 0) * p.page_table_stride;
  const uint32_t lp = pdiv.div(static_cast<uint32_t>(li >= 0 ? li : 0));
  const int32_t my_tok = li - static_cast<int32_t>(lp * pdiv.d);
  const bool want = row_ok && li >= 0 && lp < p.table_width;
  const int32_t ph = ldg32_pred(table + (want ? lp : 0), want, -1);
  const int32_t my_page = (ph >= 0 && ph < p.pages) ? ph : -1;

  const KT* kbase = static_cast<const KT*>(p.k_cache) + lane * 8;
  const KT* vbase = static_cast<const KT*>(p.v_cache) + lane * 8;
  Raw kraw[kT], vraw[kT];
  bool valid[kT];
  if constexpr (kFlat) {
    const uint32_t my_off =
        my_page >= 0 ? static_cast<uint32_t>(((int64_t(my_page) * p.k_page_stride +
                                               int64_t(my_tok) * p.k_token_stride) *
                                              int64_t(sizeof(KT))) >> 4)
                     : 0xffffffffu;
    const char* kbytes = static_cast<const char*>(p.k_cache) + lane * 8 * sizeof(KT);
#pragma unroll
    for (int j = 0; j < kT; ++j) {
      const uint32_t off = __shfl_sync(0xffffffffu, my_off, j);
      valid[j] = off != 0xffffffffu;
      const char* kt = kbytes + (static_cast<uint64_t>(valid[j] ? off : 0u) << 4);
      kraw[j] = detail::load_raw8<KT>(reinterpret_cast<const KT*>(kt), valid[j]);
      vraw[j] = detail::load_raw8<KT>(reinterpret_cast<const KT*>(kt + pdiv.vdelta), valid[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kT && !kFlat; ++j) {
    const int32_t page = __shfl_sync(0xffffffffu, my_page, j);
    const int32_t slot = __shfl_sync(0xffffffffu, my_tok, j);
    valid[j] = page >= 0;
    const int64_t pg = valid[j] ? page : 0, sl = valid[j] ? slot : 0;
    kraw[j] = load_kv<KT>(kbase, pg * p.k_page_stride + sl * p.k_token_stride, valid[j]);
    vraw[j] = load_kv<KT>(vbase, pg * p.v_page_stride + sl * p.v_token_stride, valid[j]);
  }
  {
    // NOTES: the first use is made to depend on every load (`zero` is 0 at run time, unknown
    // to the compiler), so that ptxas issues all of them before it (it sank the V loads
    // behind the first dot products otherwise: two round trips).
    const uint32_t zero = static_cast<uint32_t>(p.rows >> 62);  // rows < 2^62
    uint32_t later = vraw[0].x;
#pragma unroll
    for (int j = 1; j < kT; ++j) later |= kraw[j].x | vraw[j].x;
    kraw[0].x |= later & zero;
  }

  float qf[kHeads][8];
  q_to_float<QT>(qraw, qf);
  // value v = j * 3 + h of this lane's 8 dims
  float part[kReduce][16];
#pragma unroll
  for (int v = 0; v < kReduce * 16; ++v) part[v / 16][v % 16] = 0.f;
#pragma unroll
  for (int j = 0; j < kT; ++j) {
    float dot[kHeads];
    partial_dots<KT>(qf, kraw[j], dot);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) part[(j * kHeads + h) / 16][(j * kHeads + h) % 16] = dot[h];
  }
  float full[kReduce];
#pragma unroll
  for (int u = 0; u < kReduce; ++u) full[u] = warp_reduce16(part[u], lane);
  const float scale_log2 = p.softmax_scale * p.k_scale * kLog2e;  // fp8: k_scale folded in
  float sc[kT][kHeads];
#pragma unroll
  for (int j = 0; j < kT; ++j) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const int v = j * kHeads + h;
      const float dot = __shfl_sync(0xffffffffu, full[v / 16], 2 * (v % 16));
      sc[j][h] = valid[j] ? dot * scale_log2 : -INFINITY;
    }
  }
  float m[kHeads], l[kHeads], acc[kHeads][8];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    m[h] = -INFINITY;
#pragma unroll
    for (int j = 0; j < kT; ++j) m[h] = fmaxf(m[h], sc[j][h]);
    const float ref = m[h] == -INFINITY ? 0.f : m[h];  // holes only: every weight 0
    l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < kT; ++j) {
      sc[j][h] = exp2f(sc[j][h] - ref);  // now the weight
      l[h] += sc[j][h];
    }
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[h][d] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < kT; ++j) accumulate_v<KT>(vraw[j], sc[j], acc);

  // ---- The CTA's partial: its warps merged in warp order ----------------------------------
  publish_warp(acc, m, l, sh.acc[warp], sh.m[warp], sh.l[warp], lane);
  __syncthreads();
  if (tid < kHeads) {
    const int h = tid;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kW; ++w) mm = fmaxf(mm, sh.m[w][h]);
    float ll = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      const float f = mm == -INFINITY ? 0.f : exp2f(sh.m[w][h] - mm);
      sh.f[w][h] = f;
      ll += sh.l[w][h] * f;
    }
    sh.cm[h] = mm;
    sh.cl[h] = ll;
  }
  __syncthreads();
  float* mine = parts + (r * splits + s) * kPartStride;
#pragma unroll
  for (int o = tid; o < kOut; o += kThreadsS) {
    const int h = o / kHeadDim;
    float aa = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) aa += sh.acc[w][o] * sh.f[w][h];
    mine[o] = aa;
  }
  if (tid < kHeads) {
    mine[kOut + tid] = sh.cm[tid];
    mine[kOut + kHeads + tid] = sh.cl[tid];
  }
  __syncthreads();
  int32_t* counter = p.counters + kCounterSlots + r * kCounterSpread;
  const int add = detail::epoch_add(s == 0, splits, kSmallEpoch);
  if (s >= mergers) {
    if (tid == 0) detail::red_add_release_gpu(counter, add);
    detail::allow_dependents();  // partial released: the next kernel may take the SMs left
    return;
  }

  // ---- Mergers: wait for the row's partials, merge slices in split order ----------------
  uint32_t before = 0;
  if (tid == 0) before = static_cast<uint32_t>(atomic_add_acq_rel_gpu(counter, add));
  detail::allow_dependents();
  if (tid == 0) detail::epoch_wait(counter, before, kSmallEpoch);
  __syncthreads();
  const float* row_parts = parts + r * splits * kPartStride;
  uint16_t* out = static_cast<uint16_t*>(p.out) + r * kOut;
  const int g = warp;  // splits g, g + kW, ...
  const int i = lane;  // output of the slice
  for (int slice = s; slice < kMergeSlices; slice += mergers) {
    const int o = slice * kMergeCols + i;
    const int h = o / kHeadDim;
    float pm[kGroupSplits], pl[kGroupSplits], pa[kGroupSplits];
#pragma unroll
    for (int u = 0; u < kGroupSplits; ++u) {
      const int sp = g + u * kW;
      const float* pc = row_parts + sp * kPartStride;
      const bool in = sp < splits;
      pm[u] = in ? __ldcg(pc + kOut + h) : -INFINITY;
      pl[u] = in ? __ldcg(pc + kOut + kHeads + h) : 0.f;
      pa[u] = in ? __ldcg(pc + o) : 0.f;
    }
    float mm = -INFINITY;
#pragma unroll
    for (int u = 0; u < kGroupSplits; ++u) mm = fmaxf(mm, pm[u]);
    float ll = 0.f, aa = 0.f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int u = 0; u < kGroupSplits; ++u) {
        const float f = exp2f(pm[u] - mm);
        ll += pl[u] * f;
        aa += pa[u] * f;
      }
    }
    sh.gm[g][i] = mm;
    sh.gl[g][i] = ll;
    sh.ga[g][i] = aa;
    __syncthreads();
    if (tid < kMergeCols) {
      float m2 = -INFINITY;
#pragma unroll
      for (int w = 0; w < kW; ++w) m2 = fmaxf(m2, sh.gm[w][tid]);
      float l2 = 0.f, a2 = 0.f;
      if (m2 != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kW; ++w) {
          const float f = exp2f(sh.gm[w][tid] - m2);
          l2 += sh.gl[w][tid] * f;
          a2 += sh.ga[w][tid] * f;
        }
      }
      const int64_t o = slice * kMergeCols + tid;
      const uint16_t gb = slice == s ? gbit0 : load_gate(p.gate, r * kOut + o, gated);
      out[o] = finish_out<QT>(a2, l2, p.v_scale, gated, gb);
    }
    __syncthreads();
  }
}

// CTAs per cluster for a split count: the whole row up to 8 splits, else clusters of 8.
int cluster_size(int splits) { return splits <= kMaxCluster ? splits : kMaxCluster; }

// Splits the kernel can run for `rows`: 1..8 (one cluster), or a multiple of 8 up to 128
// when the (row, slice) counters fit.
int legal_splits(int64_t rows, int sp) {
  sp = std::max(1, std::min(sp, kMaxSplits));
  if (sp > kMaxCluster) {
    if (rows * kMaxCluster > kCounterSlots) return kMaxCluster;
    sp = (sp / kMaxCluster) * kMaxCluster;
  }
  return sp;
}

// The decode-size path: 8 warps of 4 tokens per CTA (65 CTAs per row) up to 2 rows, 8 warps
// of 8 tokens (33 per row) above, when every CTA of the grid is resident at once; else the
// cluster kernel. NOTES-kernels.md (v8) has the sweep behind the choice.
enum class Path { kCluster, kSmall4, kSmall8 };

template <int kT>
constexpr int small_splits() {
  return (kWidth + 8 * kT - 1) / (8 * kT);
}

// CTAs of the decode-size kernel resident per SM (the smaller of its two variants).
template <int kT>
int64_t small_per_sm(int device) {
  static std::atomic<int64_t> cached[64];
  if (device < 0 || device >= 64) return 0;
  int64_t n = cached[device].load(std::memory_order_relaxed);
  if (n == 0) {
    int a = 0, b = 0;  // both variants: the unaligned one may hold more registers
    // every instantiation: the fp8 ones may hold more registers
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &a, attention_small_kernel<__half, __half, 8, kT>, 8 * 32, 0) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &b, attention_small_kernel<__half, __nv_fp8_e4m3, 8, kT>, 8 * 32, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      a = b = 0;
    }
    int c = 0, d = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &c, attention_small_kernel<__nv_bfloat16, __nv_bfloat16, 8, kT>, 8 * 32, 0) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &d, attention_small_kernel<__nv_bfloat16, __nv_fp8_e4m3, 8, kT>, 8 * 32, 0) !=
            cudaSuccess) {
      (void)cudaGetLastError();
      c = d = 0;
    }
    n = int64_t(std::max(std::min(std::min(a, b), std::min(c, d)), 0)) + 1;  // 0 = not asked yet
    cached[device].store(n, std::memory_order_relaxed);
  }
  return n - 1;
}

// sms: the SMs the launch runs on (the device's, or its stream's partition).
Path choose_path(int64_t rows, int requested, int device, int64_t sms) {
  if (rows <= 0 || requested > 0 || rows > kSmallMaxRows) return Path::kCluster;
  const bool fits4 = rows * small_splits<4>() <= small_per_sm<4>(device) * sms;
  const bool fits8 = rows * small_splits<8>() <= small_per_sm<8>(device) * sms;
  if (rows <= 2 && fits4) return Path::kSmall4;
  if (fits8) return Path::kSmall8;
  return fits4 ? Path::kSmall4 : Path::kCluster;
}

// The instantiation for the params' dtypes: f(QT, KT) with tag objects.
template <typename F>
cudaError_t with_types(const AttentionParams& p, F&& f) {
  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3;
  if (p.dtype == DType::kBFloat16) {
    return fp8 ? f(__nv_bfloat16(), __nv_fp8_e4m3()) : f(__nv_bfloat16(), __nv_bfloat16());
  }
  return fp8 ? f(__half(), __nv_fp8_e4m3()) : f(__half(), __half());
}

// Whether the flat (one 32-bit offset per token) instantiations can serve p.
bool flat_layout(const AttentionParams& p) {
#if QSA_ATTN_FLAT
  if (p.k_page_stride != p.v_page_stride || p.k_token_stride != p.v_token_stride) return false;
  if (p.pages <= 0) return false;
  const int64_t es = p.kv_dtype == DType::kFloat8E4M3 ? 1 : 2;
  const int64_t last = ((p.pages - 1) * p.k_page_stride + (p.page_size - 1) * p.k_token_stride +
                        kHeadDim) * es;
  return p.k_page_stride >= 0 && p.k_token_stride >= 0 && last / 16 < int64_t(0xffffffffu);
#else
  (void)p;
  return false;
#endif
}

template <int kW, int kT>
cudaError_t launch_small(const cudaLaunchConfig_t& cfg, const AttentionParams& p,
                         const PageDiv& pdiv, int splits, int mergers, float* parts) {
  return with_types(p, [&](auto qt, auto kt) {
    using QT = decltype(qt);
    using KT = decltype(kt);
#if QSA_ATTN_FLAT
    if (flat_layout(p)) {
      return cudaLaunchKernelEx(&cfg, attention_small_kernel<QT, KT, kW, kT, true>, p, pdiv,
                                splits, mergers, parts);
    }
#endif
    return cudaLaunchKernelEx(&cfg, attention_small_kernel<QT, KT, kW, kT>, p, pdiv, splits,
                              mergers, parts);
  });
}

#if QSA_ATTN_MMA
// The opt-in above 48 KiB of shared memory, once per device and kernel (a function attribute:
// no stream work, so also while a graph is captured).
template <typename QT, typename KT, bool kDeep>
cudaError_t allow_pipe_smem(int device) {
  static std::atomic<uint64_t> done{0};  // devices 0-63; others set it at every launch
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (done.load(std::memory_order_acquire) & bit) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(
      attention_kernel<QT, KT, kDeep>, cudaFuncAttributeMaxDynamicSharedMemorySize, kPipeBytes);
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}
#endif

template <bool kDeep>
cudaError_t launch_cluster(const cudaLaunchConfig_t& cfg, int device, const AttentionParams& p,
                           const PageDiv& pdiv, int splits, int csize, float* parts) {
  return with_types(p, [&](auto qt, auto kt) {
    using QT = decltype(qt);
    using KT = decltype(kt);
#if QSA_ATTN_FLAT
    // the float8 tensor-core loop reads the slots as (page, slot): never flat
    if constexpr (!mma_path<KT>()) {
      if (flat_layout(p)) {
        return cudaLaunchKernelEx(&cfg, attention_kernel<QT, KT, kDeep, true>, p, pdiv, splits,
                                  csize, parts);
      }
    }
#endif
#if QSA_ATTN_MMA
    if constexpr (mma_path<KT>()) {  // the float8 loop's stages: dynamic shared memory
      const cudaError_t err = allow_pipe_smem<QT, KT, kDeep>(device);
      if (err != cudaSuccess) return err;
      cudaLaunchConfig_t pcfg = cfg;
      pcfg.dynamicSmemBytes = kPipeBytes;
      return cudaLaunchKernelEx(&pcfg, attention_kernel<QT, KT, kDeep>, p, pdiv, splits, csize,
                                parts);
    }
#endif
    return cudaLaunchKernelEx(&cfg, attention_kernel<QT, KT, kDeep>, p, pdiv, splits, csize,
                              parts);
  });
}


// The cluster kernel's split count (also the fallback when a cooperative grid is refused).
int cluster_splits(int64_t rows, int requested, int64_t sms) {
  if (requested > 0) return legal_splits(rows, requested);
  // NOTES: anchored on the L2-cold split sweep of the H200 (NOTES-kernels.md, v6a): the best
  // grids were 64 CTAs at R=1 (8 clusters of 8), 192 at R=8 (24 splits), 128 at R=64 (2) and
  // 256 at R=256 (1). Grids near 2 CTAs per SM with clusters (R=8 x 32, R=64 x 4) lost
  // 20-30%: not every cluster is resident at once. Small batches aim at 1.5 CTAs per SM
  // (at most 64 splits), larger ones at one CTA per SM; legal_splits rounds down.
  int64_t sp = rows <= kMaxCluster ? std::min<int64_t>(64, (3 * sms / 2) / rows)
                                   : std::min<int64_t>(kMaxCluster, sms / rows);
  sp = std::max<int64_t>(sp, 1);
  return legal_splits(rows, static_cast<int>(sp));
}

int path_splits(Path path, int64_t rows, int requested, int64_t sms) {
  switch (path) {
    case Path::kSmall4: return small_splits<4>();
    case Path::kSmall8: return small_splits<8>();
    default: return cluster_splits(rows, requested, sms);
  }
}

size_t path_workspace(Path path, int64_t rows, int splits) {
  if (path != Path::kCluster) {
    return static_cast<size_t>(rows) * splits * kPartStride * sizeof(float);
  }
  if (splits <= kMaxCluster) return 0;
  return static_cast<size_t>(rows) * (splits / kMaxCluster) * kPartStride * sizeof(float);
}

}  // namespace attention_impl

using namespace attention_impl;

int attention_splits(int64_t rows, int requested, int device) {
  if (rows <= 0) return 1;
  const int64_t sms = detail::sm_count(device);
  return path_splits(choose_path(rows, requested, device, sms), rows, requested, sms);
}

size_t attention_workspace_bytes(int64_t rows, int requested, int device) {
  if (rows <= 0) return 0;
  const int64_t sms = detail::sm_count(device);
  const Path path = choose_path(rows, requested, device, sms);
  return path_workspace(path, rows, path_splits(path, rows, requested, sms));
}

// The cluster kernel's (row, slice) counters, then the decode-size kernel's row counters.
int64_t attention_counter_slots() { return kCounterSlots + kSmallMaxRows * kCounterSpread; }

int64_t attention_launch_count(int64_t rows) { return rows > 0 ? 1 : 0; }

cudaError_t sparse_paged_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  // The workspace was sized for the whole device (attention_workspace_bytes).
  const int64_t whole = detail::sm_count(device);
  Path path = choose_path(p.rows, p.splits, device, whole);
  int splits = path_splits(path, p.rows, p.splits, whole);
  const size_t need = path_workspace(path, p.rows, splits);
  if (p.workspace_bytes < need || (p.counters == nullptr && (need > 0 || path != Path::kCluster))) {
    return cudaErrorInvalidValue;
  }
  // NOTES: a stream of a partition (green context) of fewer SMs: the decode-size grid only
  // where it is resident on the partition (decided here: a cooperative launch captured into a
  // graph is not refused, and its mergers would wait at replay for CTAs that never start),
  // else the cluster kernel with the partition's splits. That needs no more workspace than
  // the device's path: cluster_splits and its workspace grow with the SMs, and the small
  // path's workspace covers the cluster kernel's.
  const int64_t sms = detail::stream_sm_count(stream, static_cast<int>(whole));
  if (sms < whole &&
      (path == Path::kCluster || choose_path(p.rows, p.splits, device, sms) != path)) {
    path = Path::kCluster;
    splits = cluster_splits(p.rows, p.splits, sms);
  }
  if (p.page_size <= 0 || p.page_size > (int64_t(1) << 30) || p.k_cache == nullptr ||
      p.v_cache == nullptr || !detail::aligned16(p.k_cache) || !detail::aligned16(p.v_cache) ||
      (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) ||
      (p.kv_dtype != p.dtype && p.kv_dtype != DType::kFloat8E4M3)) {
    return cudaErrorInvalidValue;
  }
  PageDiv pdiv = make_page_div(p.page_size);
  pdiv.vdelta = static_cast<const char*>(p.v_cache) - static_cast<const char*>(p.k_cache);
  float* parts = static_cast<float*>(p.workspace);
  cudaLaunchConfig_t cfg = {};
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
  if (p.pdl) attr[cfg.numAttrs++] = detail::pdl_attribute();
  const unsigned common_attrs = cfg.numAttrs;
  if (path != Path::kCluster) {
    cfg.gridDim = dim3(static_cast<unsigned>(splits), static_cast<unsigned>(p.rows));
    cfg.blockDim = dim3(8 * 32);
    attr[cfg.numAttrs].id = cudaLaunchAttributeCooperative;  // the mergers wait for the others
    attr[cfg.numAttrs++].val.cooperative = 1;
    const int mergers = std::min(splits, kMergeSlices);
    err = path == Path::kSmall4 ? launch_small<8, 4>(cfg, p, pdiv, splits, mergers, parts)
                                : launch_small<8, 8>(cfg, p, pdiv, splits, mergers, parts);
    if (err != cudaErrorCooperativeLaunchTooLarge) {
      if (err != cudaSuccess) return err;
      return cudaGetLastError();
    }
    // Not every CTA resident after all: the cluster kernel, whose workspace and counters the
    // small path's cover.
    (void)cudaGetLastError();
    cfg.numAttrs = common_attrs;
    splits = cluster_splits(p.rows, p.splits, sms);
  }
  const int csize = cluster_size(splits);
  cfg.gridDim = dim3(static_cast<unsigned>(p.rows), static_cast<unsigned>(splits));
  cfg.blockDim = dim3(kThreads);
  if (csize > 1) {
    cudaLaunchAttribute& a = attr[cfg.numAttrs++];
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = 1;
    a.val.clusterDim.y = static_cast<unsigned>(csize);
    a.val.clusterDim.z = 1;
  }
  // NOTES: at most one CTA per SM (the split rule's grids from 9 to 132 rows): the deep
  // variant (NOTES-kernels.md, v9a).
  const bool deep = p.rows * splits <= sms;
  err = deep ? launch_cluster<true>(cfg, device, p, pdiv, splits, csize, parts)
             : launch_cluster<false>(cfg, device, p, pdiv, splits, csize, parts);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace qsa
