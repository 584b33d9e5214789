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
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
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
using detail::half8_to_float;
using detail::ldg32_pred;
using detail::load8;
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
constexpr int kCounterSlots = 4096;                 // one per row (kGlobal merge)
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

// Merge modes of split rows (splits > 1).
enum Mode : int {
  kSingle = 0,   // splits == 1: the CTA writes the row
  kCluster = 1,  // one thread-block cluster per row: partials pushed to rank 0 (DSMEM)
  kGlobal = 2,   // partials in the workspace, the last CTA of the row merges them
};

constexpr int kMaxClusterCtas = 16;  // non-portable cluster size (Hopper)
constexpr int kRecvBytes = kMaxClusterCtas * kPartStride * 4;
constexpr int kPartBytes = (kOut + 2 * kHeads) * 4;  // what one CTA pushes: acc, m, l

constexpr int kSmemTable = 1024;      // page-table rows up to this width are staged

struct AttnShared {
  int32_t slots[kSlotCap];             // resolved cache slots (phys * 512 + i % 512)
  int32_t table[kSmemTable];           // this row's page table (table_width <= kSmemTable)
  int warp_count[kWarps];
  float m[kWarps][kHeads];
  float l[kWarps][kHeads];
  unsigned long long recv_bar;         // kCluster: completes when all partials have landed
  int is_last;
};

// Dynamic shared memory: the K/V staging ring (kWarps x depth x 5 tokens x 1 KiB; reused for
// the per-warp outputs after the loop), then, in kCluster mode, the partials of the cluster.
constexpr int kStageTokenBytes = kTokenHalves * 2;  // 1 KiB
__host__ __device__ constexpr int stage_bytes(int depth) {
  return kWarps * depth * kTokensPerWarp * kStageTokenBytes;
}
static_assert(stage_bytes(2) >= kWarps * kOut * 4, "per-warp outputs fit in the ring");

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte async copy global -> shared; with ok == false nothing is read and zeros land.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
__device__ __forceinline__ void st_async_f32(uint32_t addr, float v, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr),
      "r"(__float_as_uint(v)), "r"(bar)
      : "memory");
}
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int32_t* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

// grid (R, splits); in kCluster mode one cluster of `splits` CTAs per row.
template <bool kVec16, int kDepth>
__global__ void __launch_bounds__(kThreads, 2)
    attention_kernel(AttentionParams p, int splits, int mode, float* __restrict__ parts) {
  __shared__ AttnShared sh;
  extern __shared__ __align__(16) unsigned char dyn[];
  uint4* stage = reinterpret_cast<uint4*>(dyn);
  float* recv = reinterpret_cast<float*>(dyn + stage_bytes(kDepth));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r = blockIdx.x;
  const int s = blockIdx.y;

  if (mode == kCluster) {
    // rank 0 receives the partials: its barrier expects every other CTA's bytes.
    if (s == 0 && tid == 0) {
      const uint32_t bar = smem_u32(&sh.recv_bar);
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                   "r"((splits - 1) * kPartBytes)
                   : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_arrive_relaxed();  // waited for just before the partials are sent
  }

  // ---- Everything that does not depend on a load is issued first ------------------------
  // q (3 x 16 B per lane), token_to_req and this warp's index columns go out together; the
  // page-table reads follow in one batch; then the K/V of the first passes.
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
  if (p.table_width <= kSmemTable) {
    // NOTES: the row's page table (<= 1024 entries) goes to shared memory as soon as
    // token_to_req is in, while the index loads are still in flight: the lookup then costs
    // no dependent global round trip after the indices (v6a: indices -> table -> K/V).
#pragma unroll
    for (int k = 0; k < kSmemTable / kThreads; ++k) {
      const int e = tid + k * kThreads;
      const int32_t v = ldg32_pred(table + (e < p.table_width ? e : 0),
                                   row_ok && e < p.table_width, -1);
      if (e < p.table_width) sh.table[e] = v;
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < kMaxRounds; ++it) {
      const int32_t i = li[it];
      const bool want = row_ok && i >= 0 && i / kKvPage < p.table_width;
      ph[it] = want ? sh.table[i / kKvPage] : -1;
    }
  } else {
#pragma unroll
    for (int it = 0; it < kMaxRounds; ++it) {
      const int32_t i = li[it];
      const bool want = row_ok && i >= 0 && i / kKvPage < p.table_width;
      ph[it] = ldg32_pred(table + (want ? i / kKvPage : 0), want, -1);
    }
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

  // ---- Online softmax: warp w takes tokens pass*40 + w*5 + t ------------------------------
  // NOTES: each warp keeps kDepth passes of K/V in flight in its own shared-memory ring
  // (cp.async, 16 B per lane; lane L copies and later reads only dims [8L, 8L+8) of K and V,
  // so no barrier is needed between copy and use). v5's register loads had one pass in flight.
  const __half* kv = static_cast<const __half*>(p.kv);
  constexpr int kPass = kWarps * kTokensPerWarp;
  const int first = warp * kTokensPerWarp;
  const int npass = total > first ? (total - first + kPass - 1) / kPass : 0;
  uint4* ring = stage + warp * (kDepth * kTokensPerWarp * 2 * 32);  // [depth][t][k|v][lane]
  auto issue = [&](int pass) {
    uint4* buf = ring + (pass % kDepth) * (kTokensPerWarp * 2 * 32);
    if constexpr (kVec16) {
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) {
        const int g = first + pass * kPass + t;
        const bool ok = pass < npass && g < total;
        const __half* tok = kv + (ok ? int64_t(slot_of(g)) * kTokenHalves : 0) + lane * 8;
        cp_async16(buf + (t * 2) * 32 + lane, tok, ok);
        cp_async16(buf + (t * 2 + 1) * 32 + lane, tok + kHeadDim, ok);
      }
      cp_async_commit();
    } else {  // unaligned K/V: synchronous 2-byte loads (a correctness path)
#pragma unroll 1
      for (int t = 0; t < 2 * kTokensPerWarp; ++t) {
        const int g = first + pass * kPass + t / 2;
        const bool ok = pass < npass && g < total;
        const __half* tok = kv + (ok ? int64_t(slot_of(g)) * kTokenHalves : 0) + lane * 8;
        buf[t * 32 + lane] = ok ? load8<false>(tok + (t % 2) * kHeadDim) : make_uint4(0, 0, 0, 0);
      }
    }
  };
#pragma unroll
  for (int d = 0; d < kDepth; ++d) issue(d);

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
  for (int pass = 0; pass < npass; ++pass) {
    const int g0 = first + pass * kPass;
    if constexpr (kVec16) cp_async_wait<kDepth - 1>();  // this pass's group has landed
    const uint4* buf = ring + (pass % kDepth) * (kTokensPerWarp * 2 * 32);
    uint4 kraw[kTokensPerWarp], vraw[kTokensPerWarp];
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
      kraw[t] = buf[(t * 2) * 32 + lane];
      vraw[t] = buf[(t * 2 + 1) * 32 + lane];
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
    issue(pass + kDepth);  // refill this pass's buffer (its values are consumed above)
  }
  if constexpr (kVec16) cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring: it now holds the per-warp outputs

  // ---- Merge the warps of this CTA (fixed order) -----------------------------------------
  float* wacc = reinterpret_cast<float*>(dyn);  // [kWarps][kOut]
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
#pragma unroll
    for (int d = 0; d < 8; d += 4) {
      *reinterpret_cast<float4*>(&wacc[warp * kOut + h * kHeadDim + lane * 8 + d]) =
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
        aa += wacc[w * kOut + h * kHeadDim + tid] * f;
      }
    }
    cta_m[h] = mm;
    cta_l[h] = ll;
    cta_acc[h] = aa;
  }

  __half* out = static_cast<__half*>(p.out) + r * kOut;
  if (mode == kSingle) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const float v = cta_l[h] > 0.f ? cta_acc[h] / cta_l[h] : 0.f;
      out[h * kHeadDim + tid] = __float2half_rn(v);
    }
    return;
  }

  if (mode == kCluster) {
    // ---- One cluster per row: rank k pushes its partial into rank 0's recv[k] ----------
    // NOTES: st.async + an mbarrier with a byte count: no memory fence and no cluster-wide
    // release barrier on the critical path (a release barrier.cluster costs a MEMBAR.GPU).
    cluster_wait();  // rank 0's barrier is initialised
    const uint32_t recv_k = smem_u32(recv + s * kPartStride);
    if (s != 0) {
      const uint32_t dst = map_rank(recv_k, 0);
      const uint32_t bar = map_rank(smem_u32(&sh.recv_bar), 0);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) st_async_f32(dst + 4 * (h * kHeadDim + tid), cta_acc[h], bar);
      if (tid < 2 * kHeads) {
        float v = 0.f;
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          if (tid == h) v = cta_m[h];
          if (tid == kHeads + h) v = cta_l[h];
        }
        st_async_f32(dst + 4 * (kOut + tid), v, bar);
      }
      cluster_arrive_relaxed();
      cluster_wait();  // leave only after rank 0 has everything
      return;
    }
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      recv[h * kHeadDim + tid] = cta_acc[h];
      if (tid == h) {
        recv[kOut + h] = cta_m[h];
        recv[kOut + kHeads + h] = cta_l[h];
      }
    }
    {
      const uint32_t bar = smem_u32(&sh.recv_bar);
      uint32_t done = 0;
      while (!done) {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(bar)
            : "memory");
      }
    }
    __syncthreads();  // rank 0's own partial (plain stores) is visible too
    cluster_arrive_relaxed();
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      float mm = -INFINITY;
      for (int k = 0; k < splits; ++k) mm = fmaxf(mm, recv[k * kPartStride + kOut + h]);
      float ll = 0.f, aa = 0.f;
      if (mm != -INFINITY) {
#pragma unroll 4
        for (int k = 0; k < splits; ++k) {
          const float* pk = recv + k * kPartStride;
          const float f = exp2f(pk[kOut + h] - mm);
          ll += pk[kOut + kHeads + h] * f;
          aa += pk[h * kHeadDim + tid] * f;
        }
      }
      out[h * kHeadDim + tid] = __float2half_rn(ll > 0.f ? aa / ll : 0.f);
    }
    cluster_wait();
    return;
  }

  // ---- kGlobal: publish the partial, the last CTA of the row merges (split order) --------
  float* part = parts + (r * splits + s) * kPartStride;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) part[h * kHeadDim + tid] = cta_acc[h];
  if (tid < kHeads) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (tid == h) {
        part[kOut + h] = cta_m[h];
        part[kOut + kHeads + h] = cta_l[h];
      }
    }
  }
  __syncthreads();
  // NOTES: one acq_rel atomic by thread 0 after the barrier (release of the CTA's partial,
  // acquire of the others' for the last CTA); v5 used two full SC fences.
  if (tid == 0) sh.is_last = atomic_add_acq_rel_gpu(&p.counters[r], 1) == splits - 1;
  __syncthreads();
  if (!sh.is_last) return;
  const float* row_parts = parts + r * splits * kPartStride;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    float mm = -INFINITY;
    for (int t = 0; t < splits; ++t) mm = fmaxf(mm, __ldcg(row_parts + t * kPartStride + kOut + h));
    float ll = 0.f, aa = 0.f;
    if (mm != -INFINITY) {
#pragma unroll 8
      for (int t = 0; t < splits; ++t) {
        const float* pt = row_parts + t * kPartStride;
        const float f = exp2f(__ldcg(pt + kOut + h) - mm);
        ll += __ldcg(pt + kOut + kHeads + h) * f;
        aa += __ldcg(pt + h * kHeadDim + tid) * f;
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

// NOTES: ring depth: 4 passes (20 KiB per warp, 1 CTA per SM) for cluster rows, where one
// CTA owns an SM anyway; 2 passes (80 KiB per CTA) elsewhere, so 2 CTAs fit per SM.
constexpr int kDepthCluster = 4;
constexpr int kDepthWide = 2;
constexpr int kMaxGlobalSplits = 64;

size_t dyn_smem(int mode) {
  return mode == kCluster ? size_t(stage_bytes(kDepthCluster)) + kRecvBytes
                          : size_t(stage_bytes(kDepthWide));
}

template <bool kVec16, int kDepth>
cudaError_t prepare(int mode) {
  cudaError_t err = cudaFuncSetAttribute(attention_kernel<kVec16, kDepth>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(dyn_smem(mode)));
  if (err == cudaSuccess && mode == kCluster) {
    err = cudaFuncSetAttribute(attention_kernel<kVec16, kDepth>,
                               cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  }
  return err;
}

// Function attributes (once per device) and how many clusters of each size can be resident
// at once (0: that size cannot be launched). Attributes are not stream operations: allowed
// during graph capture; the occupancy query is made once, before any capture normally.
struct DeviceInfo {
  int sms = 132;
  int max_clusters[kMaxClusterCtas + 1] = {};
  cudaError_t status = cudaSuccess;
};

const DeviceInfo& device_info(int device) {
  static DeviceInfo infos[64];
  static std::atomic<uint64_t> ready{0};
  static std::mutex mu;
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  static DeviceInfo fallback;
  if (!bit) return fallback;
  if (ready.load(std::memory_order_acquire) & bit) return infos[device];
  std::lock_guard<std::mutex> lock(mu);
  if (ready.load(std::memory_order_relaxed) & bit) return infos[device];
  DeviceInfo& info = infos[device];
  int previous = device;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != device) cudaSetDevice(device);
  info.sms = sm_count(device);
  cudaError_t err = prepare<true, kDepthWide>(kGlobal);
  if (err == cudaSuccess) err = prepare<false, kDepthWide>(kGlobal);
  if (err == cudaSuccess) err = prepare<true, kDepthCluster>(kCluster);
  if (err == cudaSuccess) err = prepare<false, kDepthCluster>(kCluster);
  info.status = err;
  if (err == cudaSuccess) {
    for (int k = 2; k <= kMaxClusterCtas; ++k) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(1, static_cast<unsigned>(k));
      cfg.blockDim = dim3(kThreads);
      cfg.dynamicSmemBytes = dyn_smem(kCluster);
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = 1;
      attr[0].val.clusterDim.y = static_cast<unsigned>(k);
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int n = 0;
      if (cudaOccupancyMaxActiveClusters(&n, attention_kernel<true, kDepthCluster>, &cfg) !=
          cudaSuccess) {
        n = 0;
        (void)cudaGetLastError();  // a refused size is not an error of the call
      }
      info.max_clusters[k] = n;
    }
  }
  if (previous != device) cudaSetDevice(previous);
  ready.fetch_or(bit, std::memory_order_release);
  return info;
}

struct Plan {
  int splits = 1;
  int mode = kSingle;
};

bool force_global() {
  const char* v = std::getenv("QSA_ATTN_MERGE");
  return v != nullptr && std::strcmp(v, "global") == 0;
}

Plan make_plan(int64_t rows, int requested, int device) {
  Plan plan;
  if (rows <= 0) return plan;
  const DeviceInfo& info = device_info(device);
  const bool global_only = force_global();
  auto cluster_fits = [&](int k) {
    return !global_only && k >= 2 && k <= kMaxClusterCtas && info.max_clusters[k] >= 1;
  };
  if (requested > 0) {
    plan.splits = std::min(requested, kMaxGlobalSplits);
    if (plan.splits == 1) return plan;
    if (cluster_fits(plan.splits)) {
      plan.mode = kCluster;
    } else if (rows <= kCounterSlots) {
      plan.mode = kGlobal;
    } else {
      plan.splits = 1;
    }
    return plan;
  }
  // NOTES: small batches: one cluster of 16 CTAs per row (129 columns each) when all rows'
  // clusters are resident at once; the merge is then 15 DSMEM pushes, no global round trip.
  if (cluster_fits(kMaxClusterCtas) && rows <= info.max_clusters[kMaxClusterCtas]) {
    plan.splits = kMaxClusterCtas;
    plan.mode = kCluster;
    return plan;
  }
  // Otherwise: minimise (waves x 40-token passes) + a merge cost per partial, 2 resident CTAs
  // per SM. R=64 -> 4, R>=264 -> 1 on a 132-SM H200.
  constexpr int64_t kPass = kWarps * kTokensPerWarp;
  constexpr int64_t kMergeCost = 8;
  const int64_t slots = 2 * int64_t(info.sms);
  int64_t best_cost = INT64_MAX;
  const int max_sp = rows <= kCounterSlots ? kMaxGlobalSplits : 1;
  for (int sp = 1; sp <= max_sp; ++sp) {
    const int64_t chunk = (kWidth + sp - 1) / sp;
    const int64_t waves = (rows * sp + slots - 1) / slots;
    const int64_t cost = waves * ((chunk + kPass - 1) / kPass) * kPass + kMergeCost * (sp - 1);
    if (cost < best_cost) {
      best_cost = cost;
      plan.splits = sp;
    }
  }
  plan.mode = plan.splits > 1 ? kGlobal : kSingle;
  return plan;
}

}  // namespace attention_impl

using namespace attention_impl;

int attention_splits(int64_t rows, int requested, int device) {
  return make_plan(rows, requested, device).splits;
}

size_t attention_workspace_bytes(int64_t rows, int requested, int device) {
  const Plan plan = make_plan(rows, requested, device);
  if (plan.mode != kGlobal) return 0;
  return static_cast<size_t>(rows) * plan.splits * kPartStride * sizeof(float);
}

int64_t attention_counter_slots() { return kCounterSlots; }

int64_t attention_launch_count(int64_t rows) { return rows > 0 ? 1 : 0; }

cudaError_t sparse_paged_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const DeviceInfo& info = device_info(device);
  if (info.status != cudaSuccess) return info.status;
  const Plan plan = make_plan(p.rows, p.splits, device);
  if (plan.mode == kGlobal) {
    if (p.workspace_bytes < attention_workspace_bytes(p.rows, p.splits, device) ||
        p.counters == nullptr) {
      return cudaErrorInvalidValue;
    }
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.rows), static_cast<unsigned>(plan.splits));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = dyn_smem(plan.mode);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (plan.mode == kCluster) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = static_cast<unsigned>(plan.splits);
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  float* parts = static_cast<float*>(p.workspace);
  const bool vec16 = detail::aligned16(p.q) && detail::aligned16(p.kv);
  if (plan.mode == kCluster) {
    err = vec16 ? cudaLaunchKernelEx(&cfg, attention_kernel<true, kDepthCluster>, p, plan.splits,
                                     plan.mode, parts)
                : cudaLaunchKernelEx(&cfg, attention_kernel<false, kDepthCluster>, p,
                                     plan.splits, plan.mode, parts);
  } else {
    err = vec16 ? cudaLaunchKernelEx(&cfg, attention_kernel<true, kDepthWide>, p, plan.splits,
                                     plan.mode, parts)
                : cudaLaunchKernelEx(&cfg, attention_kernel<false, kDepthWide>, p, plan.splits,
                                     plan.mode, parts);
  }
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace qsa
