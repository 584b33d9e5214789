// Sparse paged attention over the exact-packed FP16 cache (contract section 2).
//
// One launch. grid (R, splits): CTA (r, s) takes columns [s*chunk, (s+1)*chunk) of row r,
// resolves them to cache slots (holes and out-of-table entries dropped, duplicates kept),
// and runs an online softmax over them. Each token is 1 KiB (256 K halves then 256 V halves):
// a warp reads it with one 16-byte load per lane for K and one for V, once for all 3 heads.
// With splits > 1 every CTA writes its partial (max, sum, unnormalised output) to the
// workspace, and the last CTA of the row (a counter per row, reset by that CTA) merges the
// partials in split order, so the result does not depend on which CTA finishes last.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "qsa.h"

namespace qsa {
// NOTES: a named namespace, not an anonymous one: nvcc names anonymous-namespace kernels
// after a hash of the source's absolute path, which would make the DSO depend on where it
// was built.
namespace attention_impl {

using detail::half8_to_float;
using detail::load8;

constexpr int kHeads = QSA_ATTN_HEADS;     // 3
constexpr int kHeadDim = QSA_HEAD_DIM;     // 256
constexpr int kKvPage = QSA_KV_PAGE;       // 512 tokens per page
constexpr int kWidth = QSA_WIDTH;          // 2051
constexpr int kTokenHalves = 2 * kHeadDim; // K then V
static_assert(kHeadDim == 32 * 8, "a warp of 32 lanes x 8 halves covers one head vector");
static_assert(kHeads == 3, "partials are laid out for 3 heads");

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTokensPerWarp = 4;  // tokens in flight per warp iteration (8 x 16 B per lane)
constexpr int kOut = kHeads * kHeadDim;             // 768 outputs per row
constexpr int kPartStride = kOut + 8;               // floats: 768 acc, 3 max, 3 sum, 2 pad
constexpr int kMaxSplits = 32;
constexpr int kMinChunk = kWarps * kTokensPerWarp;  // 32 columns
constexpr int kCounterSlots = 4096;
// Per-warp compacted regions: each warp owns ceil(chunk / 256) * 32 slots.
constexpr int kSlotCap = kWarps * ((kWidth + kThreads - 1) / kThreads) * 32;
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kThreads == kHeadDim, "the CTA merge gives each thread one dim of every head");

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

struct AttnShared {
  int32_t slots[kSlotCap];             // resolved cache slots (phys * 512 + i % 512)
  int warp_count[kWarps];
  float acc[kWarps][kOut];             // per-warp unnormalised outputs
  float m[kWarps][kHeads];
  float l[kWarps][kHeads];
  int is_last;
};

template <bool kVec16>
__global__ void __launch_bounds__(kThreads, 2)
    attention_kernel(AttentionParams p, int splits, int chunk, float* __restrict__ parts) {
  __shared__ AttnShared sh;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r = blockIdx.x;
  const int s = blockIdx.y;
  const int64_t b = p.token_to_req[r];
  const bool row_ok = b >= 0 && b < p.requests;
  const int c_lo = s * chunk;
  const int c_hi = min(c_lo + chunk, kWidth);

  // ---- Resolve this CTA's columns to cache slots (one pass) ------------------------------
  // Warp w compacts the valid entries of its column segment, in column order, into its own
  // region sh.slots[w * seg ...]; token g of the CTA is then found through the warp bases.
  const int seg = ((c_hi - c_lo + kThreads - 1) / kThreads) * 32;
  const int seg_lo = c_lo + warp * seg;
  const int seg_hi = min(seg_lo + seg, c_hi);
  const int32_t* idx_row = p.logical_indices + r * p.indices_stride;
  const int32_t* table = p.page_table + (row_ok ? b : 0) * p.page_table_stride;
  int count = 0;
  if (row_ok) {
    const unsigned lt = (1u << lane) - 1u;
    for (int c0 = seg_lo; c0 < seg_hi; c0 += 32) {
      const int c = c0 + lane;
      bool ok = false;
      int32_t slot = 0;
      if (c < seg_hi) {
        const int32_t i = idx_row[c];
        if (i >= 0 && i / kKvPage < p.table_width) {
          const int32_t phys = table[i / kKvPage];
          if (phys >= 0 && phys < p.pages) {
            ok = true;
            slot = phys * kKvPage + (i % kKvPage);  // < P * 512 <= INT32_MAX (checked by caller)
          }
        }
      }
      const unsigned bits = __ballot_sync(0xffffffffu, ok);
      if (ok) sh.slots[warp * seg + count + __popc(bits & lt)] = slot;
      count += __popc(bits);
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

  // ---- Online softmax: warp w takes tokens it*32 + w*4 + t --------------------------------
  // Lane covers dims [8 lane, 8 lane + 8) of every head.
  float qf[kHeads][8];
  const __half* q = static_cast<const __half*>(p.q) + r * kOut;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    const uint4 raw = load8<kVec16>(q + h * kHeadDim + lane * 8);
    half8_to_float(raw, qf[h]);
  }
  const float scale_log2 = p.softmax_scale * kLog2e;
  float m[kHeads], l[kHeads], acc[kHeads][8];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[h][d] = 0.f;
  }
  const __half* kv = static_cast<const __half*>(p.kv);
  for (int g0 = warp * kTokensPerWarp; g0 < total; g0 += kWarps * kTokensPerWarp) {
    uint4 kraw[kTokensPerWarp], vraw[kTokensPerWarp];
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
      if (g0 + t < total) {
        const __half* tok = kv + int64_t(slot_of(g0 + t)) * kTokenHalves + lane * 8;
        kraw[t] = load8<kVec16>(tok);
        vraw[t] = load8<kVec16>(tok + kHeadDim);
      } else {
        kraw[t] = make_uint4(0, 0, 0, 0);
        vraw[t] = make_uint4(0, 0, 0, 0);
      }
    }
    // Partial dots of this lane's 8 dims: value v = t * 3 + h (12 of 16; 12..15 stay 0).
    float part[16];
#pragma unroll
    for (int v = 0; v < 16; ++v) part[v] = 0.f;
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
      float kf[8];
      half8_to_float(kraw[t], kf);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        float d0 = 0.f;
#pragma unroll
        for (int d = 0; d < 8; ++d) d0 = fmaf(qf[h][d], kf[d], d0);
        part[t * kHeads + h] = d0;
      }
    }
    // NOTES: transposed butterfly: 16 values over 32 lanes in 8+4+2+1+1 = 16 shuffles (12
    // independent warp_sums would take 60, in chains of 5); lane L ends with the full sum of
    // value L >> 1, then 12 broadcasts hand every lane all scores.
    const float full = warp_reduce16(part, lane);
    float sc[kTokensPerWarp][kHeads];
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float dot = __shfl_sync(0xffffffffu, full, 2 * (t * kHeads + h));
        sc[t][h] = (g0 + t < total) ? dot * scale_log2 : -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      float m_new = m[h];
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) m_new = fmaxf(m_new, sc[t][h]);
      const float alpha = exp2f(m[h] - m_new);  // m = -inf the first time: alpha = 0
      float pr[kTokensPerWarp];
      float psum = 0.f;
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) {
        pr[t] = exp2f(sc[t][h] - m_new);  // padding tokens: exp2(-inf) = 0
        psum += pr[t];
      }
      l[h] = l[h] * alpha + psum;
      m[h] = m_new;
#pragma unroll
      for (int d = 0; d < 8; ++d) acc[h][d] *= alpha;
    }
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
      float vf[8];
      half8_to_float(vraw[t], vf);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float pt = exp2f(sc[t][h] - m[h]);
#pragma unroll
        for (int d = 0; d < 8; ++d) acc[h][d] = fmaf(pt, vf[d], acc[h][d]);
      }
    }
  }

  // ---- Merge the warps of this CTA (fixed order) -----------------------------------------
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
#pragma unroll
    for (int d = 0; d < 8; d += 4) {
      *reinterpret_cast<float4*>(&sh.acc[warp][h * kHeadDim + lane * 8 + d]) =
          make_float4(acc[h][d], acc[h][d + 1], acc[h][d + 2], acc[h][d + 3]);
    }
    if (lane == 0) {
      sh.m[warp][h] = m[h];
      sh.l[warp][h] = l[h];
    }
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

  __half* out = static_cast<__half*>(p.out) + r * kOut;
  if (splits == 1) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const float v = cta_l[h] > 0.f ? cta_acc[h] / cta_l[h] : 0.f;
      out[h * kHeadDim + tid] = __float2half_rn(v);
    }
    return;
  }

  // ---- Split rows: publish the partial, the last CTA of the row merges -------------------
  float* part = parts + (r * splits + s) * kPartStride;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) part[h * kHeadDim + tid] = cta_acc[h];
  if (tid == 0) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      part[kOut + h] = cta_m[h];
      part[kOut + kHeads + h] = cta_l[h];
    }
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int prev = atomicAdd(&p.counters[r], 1);
    sh.is_last = prev == splits - 1;
  }
  __syncthreads();
  if (!sh.is_last) return;
  __threadfence();
  // The split maxima and sums (6 floats per split) go to shared memory in one round trip;
  // then each thread merges its 3 outputs with all split loads in flight.
  const float* row_parts = parts + r * splits * kPartStride;
  float* ml = &sh.acc[0][0];  // splits * 6 <= 192 floats; sh.acc is free after the CTA merge
  for (int i = tid; i < splits * 2 * kHeads; i += kThreads) {
    ml[i] = __ldcg(row_parts + (i / (2 * kHeads)) * kPartStride + kOut + i % (2 * kHeads));
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    float mm = -INFINITY;
    for (int t = 0; t < splits; ++t) mm = fmaxf(mm, ml[t * 2 * kHeads + h]);
    float ll = 0.f, aa = 0.f;
    if (mm != -INFINITY) {
#pragma unroll 8
      for (int t = 0; t < splits; ++t) {
        const float f = exp2f(ml[t * 2 * kHeads + h] - mm);
        ll += ml[t * 2 * kHeads + kHeads + h] * f;
        aa += __ldcg(row_parts + t * kPartStride + h * kHeadDim + tid) * f;
      }
    }
    out[h * kHeadDim + tid] = __float2half_rn(ll > 0.f ? aa / ll : 0.f);
  }
  if (tid == 0) p.counters[r] = 0;  // ready for the next call (and graph replay)
}

int sm_count(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 132;
  }
  return sms > 0 ? sms : 132;
}

int chunk_for(int splits) {
  const int c = (kWidth + splits - 1) / splits;
  return ((c + kMinChunk - 1) / kMinChunk) * kMinChunk;
}

}  // namespace attention_impl

using namespace attention_impl;

int attention_splits(int64_t rows, int requested, int device) {
  if (rows <= 0 || rows > kCounterSlots) return 1;
  if (requested > 0) {
    // Only splits whose chunks are all non-empty (chunk_for rounds up to 32 columns).
    int sp = std::min(requested, kMaxSplits);
    while (sp > 1 && (kWidth + chunk_for(sp) - 1) / chunk_for(sp) != sp) --sp;
    return sp;
  }
  // NOTES: choose the split that minimises (waves x columns per CTA) + a merge cost of
  // kMergeCost columns per partial; 2 CTAs of 256 threads fit per SM (register-bound).
  // R=1 -> 16 splits of 129 columns, R=64 -> 4, R>=264 -> 1 on a 132-SM H200.
  constexpr int64_t kMergeCost = 8;
  const int64_t slots = 2 * int64_t(sm_count(device));
  int best = 1;
  int64_t best_cost = INT64_MAX;
  for (int sp = 1; sp <= kMaxSplits; ++sp) {
    const int c = chunk_for(sp);
    const int eff = (kWidth + c - 1) / c;  // splits actually populated
    if (eff != sp) continue;
    const int64_t waves = (rows * sp + slots - 1) / slots;
    const int64_t cost = waves * c + (sp > 1 ? kMergeCost * sp : 0);
    if (cost < best_cost) {
      best_cost = cost;
      best = sp;
    }
  }
  return best;
}

size_t attention_workspace_bytes(int64_t rows, int requested, int device) {
  const int sp = attention_splits(rows, requested, device);
  if (sp <= 1) return 0;
  return static_cast<size_t>(rows) * sp * kPartStride * sizeof(float);
}

int64_t attention_counter_slots() { return kCounterSlots; }

int64_t attention_launch_count(int64_t rows) { return rows > 0 ? 1 : 0; }

cudaError_t sparse_paged_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const int splits = attention_splits(p.rows, p.splits, device);
  if (splits > 1) {
    if (p.workspace_bytes < attention_workspace_bytes(p.rows, p.splits, device) ||
        p.counters == nullptr) {
      return cudaErrorInvalidValue;
    }
  }
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(splits));
  float* parts = static_cast<float*>(p.workspace);
  if (detail::aligned16(p.q) && detail::aligned16(p.kv)) {
    attention_kernel<true><<<grid, kThreads, 0, stream>>>(p, splits, chunk_for(splits), parts);
  } else {
    attention_kernel<false><<<grid, kThreads, 0, stream>>>(p, splits, chunk_for(splits), parts);
  }
  return cudaGetLastError();
}

}  // namespace qsa
