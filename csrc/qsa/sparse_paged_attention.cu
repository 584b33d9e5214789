// Sparse paged attention over the exact-packed FP16 cache (contract section 2).
//
// One launch. grid (R, splits): CTA (r, s) takes the balanced column range
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

namespace cg = cooperative_groups;
using detail::atomic_add_acq_rel_gpu;
using detail::half8_to_float;
using detail::ldg32_pred;
using detail::load8_pred;

constexpr int kHeads = QSA_ATTN_HEADS;     // 3
constexpr int kHeadDim = QSA_HEAD_DIM;     // 256
constexpr int kKvPage = QSA_KV_PAGE;       // 512 tokens per page
constexpr int kWidth = QSA_WIDTH;          // 2051
constexpr int kTokenHalves = 2 * kHeadDim; // K then V
static_assert(kHeadDim == 32 * 8, "a warp of 32 lanes x 8 halves covers one head vector");
static_assert(kHeads == 3, "partials are laid out for 3 heads");

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// NOTES: 5 tokens per warp pass fill 15 of the transposed butterfly's 16 values (4 used 12):
// 10 16-byte loads per lane in flight, a 40-token pass per CTA.
constexpr int kTokensPerWarp = 5;
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
static_assert(kThreads == kHeadDim, "the CTA merge gives each thread one dim of every head");
static_assert(kTokensPerWarp * kHeads <= 16, "one transposed butterfly per pass");

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
  float cta_acc[kOut];                 // this CTA's partial, read by its cluster (DSMEM)
  float cta_m[kHeads];
  float cta_l[kHeads];
  int is_last;
};

__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// grid (R, splits), clusters of `csize` CTAs along y (csize = 1 when splits == 1).
template <bool kVec16>
__global__ void __launch_bounds__(kThreads, 2)
    attention_kernel(AttentionParams p, int splits, int csize, float* __restrict__ parts) {
  __shared__ AttnShared sh;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r = blockIdx.x;
  const int s = blockIdx.y;

  // ---- Everything that does not depend on a load is issued first ------------------------
  // q (3 x 16 B per lane), token_to_req and this warp's index columns go out together; the
  // page-table reads follow in one batch; then the K/V of the first pass.
  const __half* q = static_cast<const __half*>(p.q) + r * kOut;
  uint4 qraw[kHeads];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) qraw[h] = load8_pred<kVec16>(q + h * kHeadDim + lane * 8, true);
  const int64_t b = ldg32_pred(p.token_to_req + r, true, -1);

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
    li[it] = ldg32_pred(idx_row + (c < seg_hi ? c : 0), it < rounds && c < seg_hi, -1);
  }
  const bool row_ok = b >= 0 && b < p.requests;
  const int32_t* table = p.page_table + (row_ok ? b : 0) * p.page_table_stride;
  int32_t ph[kMaxRounds];
#pragma unroll
  for (int it = 0; it < kMaxRounds; ++it) {
    const int32_t i = li[it];
    const bool want = row_ok && i >= 0 && i / kKvPage < p.table_width;
    ph[it] = ldg32_pred(table + (want ? i / kKvPage : 0), want, -1);
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
        // < P * 512 <= INT32_MAX (checked by the caller)
        const int32_t slot = ph[it] * kKvPage + (li[it] % kKvPage);
        const unsigned bits = __ballot_sync(0xffffffffu, ok);
        if (ok) sh.slots[warp * seg + count + __popc(bits & lt)] = slot;
        count += __popc(bits);
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

  // ---- Online softmax: warp w takes tokens it*40 + w*5 + t --------------------------------
  // Lane covers dims [8 lane, 8 lane + 8) of every head.
  float qf[kHeads][8];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) half8_to_float(qraw[h], qf[h]);
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
    int slot[kTokensPerWarp];
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) slot[t] = g0 + t < total ? slot_of(g0 + t) : 0;
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
      const __half* tok = kv + int64_t(slot[t]) * kTokenHalves + lane * 8;
      kraw[t] = load8_pred<kVec16>(tok, g0 + t < total);
      vraw[t] = load8_pred<kVec16>(tok + kHeadDim, g0 + t < total);
    }
    // Partial dots of this lane's 8 dims: value v = t * 3 + h (15 of 16; 15 stays 0).
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
    // NOTES: transposed butterfly: 16 values over 32 lanes in 8+4+2+1+1 = 16 shuffles (15
    // independent warp_sums would take 75, in chains of 5); lane L ends with the full sum of
    // value L >> 1, then 15 broadcasts hand every lane all scores.
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
      if (o < o_hi) out[o] = __float2half_rn(lo[u] > 0.f ? ao[u] / lo[u] : 0.f);
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
          out[o] = __float2half_rn(ll > 0.f ? aa / ll : 0.f);
        }
      }
      if (tid == 0) *counter = 0;  // ready for the next call (and graph replay)
    }
  }
  cluster_wait_acquire();  // no CTA leaves while its shared memory may still be read
}

int sm_count(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 132;
  }
  return sms > 0 ? sms : 132;
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

}  // namespace attention_impl

using namespace attention_impl;

int attention_splits(int64_t rows, int requested, int device) {
  if (rows <= 0) return 1;
  if (requested > 0) return legal_splits(rows, requested);
  // NOTES: anchored on the L2-cold split sweep of the H200 (NOTES-kernels.md, v6a): the best
  // grids were 64 CTAs at R=1 (8 clusters of 8), 192 at R=8 (24 splits), 128 at R=64 (2) and
  // 256 at R=256 (1). Grids near 2 CTAs per SM with clusters (R=8 x 32, R=64 x 4) lost
  // 20-30%: not every cluster is resident at once. Small batches aim at 1.5 CTAs per SM
  // (at most 64 splits), larger ones at one CTA per SM; legal_splits rounds down.
  const int64_t sms = sm_count(device);
  int64_t sp = rows <= kMaxCluster ? std::min<int64_t>(64, (3 * sms / 2) / rows)
                                   : std::min<int64_t>(kMaxCluster, sms / rows);
  sp = std::max<int64_t>(sp, 1);
  return legal_splits(rows, static_cast<int>(sp));
}

size_t attention_workspace_bytes(int64_t rows, int requested, int device) {
  const int sp = attention_splits(rows, requested, device);
  if (sp <= kMaxCluster) return 0;
  return static_cast<size_t>(rows) * (sp / kMaxCluster) * kPartStride * sizeof(float);
}

int64_t attention_counter_slots() { return kCounterSlots; }

int64_t attention_launch_count(int64_t rows) { return rows > 0 ? 1 : 0; }

cudaError_t sparse_paged_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const int splits = attention_splits(p.rows, p.splits, device);
  const int csize = cluster_size(splits);
  if (splits > kMaxCluster) {
    if (p.workspace_bytes < attention_workspace_bytes(p.rows, p.splits, device) ||
        p.counters == nullptr) {
      return cudaErrorInvalidValue;
    }
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.rows), static_cast<unsigned>(splits));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (csize > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = static_cast<unsigned>(csize);
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  float* parts = static_cast<float*>(p.workspace);
  if (detail::aligned16(p.q) && detail::aligned16(p.kv)) {
    err = cudaLaunchKernelEx(&cfg, attention_kernel<true>, p, splits, csize, parts);
  } else {
    err = cudaLaunchKernelEx(&cfg, attention_kernel<false>, p, splits, csize, parts);
  }
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace qsa
