// Floor probes of the decode-size attention (R small): skeleton kernels that do only what any
// kernel of a given structure must do for sparse_paged_attention, and nothing of its
// arithmetic. Timed beside the real kernel by scripts/floor_probes.py (the benchmark's timer,
// its rotated inputs); NOTES-kernels.md, "Floor probes".
//
// Every probe reads the row's inputs the way the decode-size kernel does: level 1 q,
// token_to_req and the index columns; level 2 the page-table entries; level 3 every K/V line
// (1 KiB per token), all of a warp's loads issued before the first is used; the loaded words
// are folded with XOR (so that none can be dropped) and the fold written out. Every fold waits
// for all of its loads (gated_fold): a fold that consumed each load as it arrived let ptxas
// issue the next load after it, one round trip per load, and a probe must not be slower than
// the structure it stands for.
//
//   launch            the grid of CTAs and nothing else (the launch and completion floor)
//   loads<kW,kT>      grid (splits, R) of kW warps x kT tokens: the three load levels, the
//                     CTA's warps combined (one barrier), one word per CTA written
//   exchange<kW,kT>   loads, then the one cross-CTA hand-off a split row needs: every CTA
//                     releases its word on the row's epoch counter, CTA 0 acquires them all,
//                     reads the words back and writes the row's result
//   wide<kT>          loads, then the decode-size kernel's own hand-off: a whole partial (768
//                     sums, 3 maxima, 3 sums) per CTA, 24 merging CTAs reading their slices
//                     of every partial (float16 sums: half the bytes); decomposition modes
//   tree<kC,kT>       clusters of kC CTAs gathering their partials over distributed shared
//                     memory, then the cluster partials handed off through global memory
//   cluster<kC>       one cluster of kC CTAs (1024 threads each) per row: the loads, then the
//                     CTAs' words gathered over distributed shared memory (no global hand-off)
//   single            one CTA (1024 threads) per row loading the whole row in chunks (an
//                     indication of one SM, not a tuned single-CTA kernel)
//
// Not part of the library: built at run time with nvcc, loaded with ctypes.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "../csrc/qsa/common.cuh"
#include "../csrc/qsa/contract.h"

namespace {

using qsa::detail::allow_dependents;
using qsa::detail::grid_dependency_wait;
using qsa::detail::kFirst;
using qsa::detail::ldg16_pred;
using qsa::detail::ldg32_pred;

constexpr int kWidth = QSA_WIDTH;
constexpr int kKvPage = QSA_KV_PAGE;
constexpr int kTokenHalves = 2 * QSA_HEAD_DIM;
constexpr uint32_t kEpoch = 512;  // added to a row counter per call (>= every split count)
constexpr int kOut = QSA_ATTN_HEADS * QSA_HEAD_DIM;   // 768 outputs per row
constexpr int kSlices = kOut / 32;                    // 24 merge slices of 32 outputs

struct Probe {
  const __half* q;
  const __half* kv;
  const int32_t* indices;
  int64_t indices_stride;
  const int32_t* table;
  int64_t table_stride;
  const int32_t* token_to_req;
  int64_t requests, table_width, pages;
  uint32_t* words;     // one per (row, CTA); a whole partial per (row, CTA) for the wide ones
  int32_t* counters;   // one per row, 32 apart
  uint32_t* out;       // one per row; kOut per row for the wide probes
};

// Warp: kT columns from `col0`, the three load levels, every loaded word folded. Levels 1-2
// are attention_small_kernel's, line for line (a probe must load what the kernel loads); they
// move into a helper of csrc/qsa/common.cuh shared by both with the kernel's next change (a
// change there is a change of the validated library's sources).
template <int kT>
__device__ __forceinline__ uint32_t warp_tokens(const Probe& p, int64_t r, int col0, int lane,
                                                bool with_q) {
  uint32_t x = 0;
  if (with_q) {
    const __half* qr = p.q + r * (QSA_ATTN_HEADS * QSA_HEAD_DIM) + lane * 8;
#pragma unroll
    for (int h = 0; h < QSA_ATTN_HEADS; ++h) {
      const uint4 v = ldg16_pred<kFirst>(qr + h * QSA_HEAD_DIM, true);
      x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  const int64_t b = ldg32_pred<kFirst>(p.token_to_req + r, true, -1);
  const int col = col0 + lane;
  const bool have = lane < kT && col < kWidth;
  const int32_t li = ldg32_pred<kFirst>(p.indices + r * p.indices_stride + (have ? col : 0),
                                        have, -1);
  const bool row_ok = b >= 0 && b < p.requests;
  const int32_t* table = p.table + (row_ok ? b : 0) * p.table_stride;
  const bool want = row_ok && li >= 0 && li / kKvPage < p.table_width;
  const int32_t ph = ldg32_pred(table + (want ? li / kKvPage : 0), want, -1);
  const int32_t my_slot = (ph >= 0 && ph < p.pages) ? ph * kKvPage + li % kKvPage : -1;
  uint4 k[kT], v[kT];
#pragma unroll
  for (int j = 0; j < kT; ++j) {
    const int32_t slot = __shfl_sync(0xffffffffu, my_slot, j);
    const bool valid = slot >= 0;
    const __half* tok = p.kv + int64_t(valid ? slot : 0) * kTokenHalves + lane * 8;
    k[j] = ldg16_pred(tok, valid);
    v[j] = ldg16_pred(tok + QSA_HEAD_DIM, valid);
  }
  // Every fold term waits for every load (`gate` is 0 at run time, unknown to the compiler,
  // and an addition does not reassociate with the XORs): without it ptxas folded each token as
  // it arrived and issued the next token's loads after that, one DRAM round trip per token
  // (the kernel's own loads are kept together the same way: its "first use" note).
  const uint32_t zero = static_cast<uint32_t>(p.pages >> 62);  // pages < 2^62
  uint32_t all = 0;
#pragma unroll
  for (int j = 0; j < kT; ++j) all |= k[j].x | v[j].x;
  const uint32_t gate = all & zero;
#pragma unroll
  for (int j = 0; j < kT; ++j) {
    x ^= (k[j].x + gate) ^ (k[j].y + gate) ^ (k[j].z + gate) ^ (k[j].w + gate);
    x ^= (v[j].x + gate) ^ (v[j].y + gate) ^ (v[j].z + gate) ^ (v[j].w + gate);
  }
  return __reduce_xor_sync(0xffffffffu, x);
}

// XOR of n loaded words, every term waiting for every load (see warp_tokens).
template <int n>
__device__ __forceinline__ uint32_t gated_fold(const uint32_t (&v)[n], const Probe& p) {
  const uint32_t zero = static_cast<uint32_t>(p.pages >> 62);  // pages < 2^62
  uint32_t all = 0;
#pragma unroll
  for (int i = 0; i < n; ++i) all |= v[i];
  const uint32_t gate = all & zero;
  uint32_t z = 0;
#pragma unroll
  for (int i = 0; i < n; ++i) z ^= v[i] + gate;
  return z;
}

// The CTA's warps combined: one barrier; the result in thread 0.
template <int kW>
__device__ __forceinline__ uint32_t cta_fold(uint32_t x, int tid) {
  __shared__ uint32_t sh[kW];
  if ((tid & 31) == 0) sh[tid >> 5] = x;
  __syncthreads();
  uint32_t y = 0;
  if (tid == 0) {
#pragma unroll
    for (int w = 0; w < kW; ++w) y ^= sh[w];
  }
  return y;
}

__global__ void probe_launch(Probe p) {
  grid_dependency_wait();
  allow_dependents();
  if (threadIdx.x == 0 && blockIdx.x == 0) p.out[blockIdx.y] = blockIdx.y;
}

template <int kW, int kT, bool kExchange>
__global__ void __launch_bounds__(kW * 32) probe_split(Probe p) {
  grid_dependency_wait();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = blockIdx.x, splits = gridDim.x;
  const int64_t r = blockIdx.y;
  const uint32_t x = warp_tokens<kT>(p, r, (s * kW + warp) * kT, lane, true);
  const uint32_t y = cta_fold<kW>(x, tid);
  if (!kExchange) {
    if (tid == 0) p.words[r * splits + s] = y;
    allow_dependents();
    return;
  }
  int32_t* counter = p.counters + r * 32;
  const int add = s == 0 ? 1 + int(kEpoch) - splits : 1;
  if (s != 0) {
    if (tid == 0) {
      __stcg(p.words + r * splits + s, y);
      qsa::detail::red_add_release_gpu(counter, add);
    }
    allow_dependents();
    return;
  }
  __shared__ uint32_t acc;
  if (tid == 0) {
    acc = y;
    const uint32_t before = static_cast<uint32_t>(qsa::detail::atomic_add_acq_rel_gpu(counter, add));
    const uint32_t done = (before & ~(kEpoch - 1)) + kEpoch;
    while (static_cast<int32_t>(static_cast<uint32_t>(qsa::detail::ld_acquire_gpu(counter)) - done) < 0) {
    }
  }
  allow_dependents();
  __syncthreads();
  for (int i = tid; i < splits; i += kW * 32) {
    if (i > 0) atomicXor(&acc, __ldcg(p.words + r * splits + i));
  }
  __syncthreads();
  if (tid == 0) p.out[r] = acc;
}

// The decode-size kernel's hand-off with its data: every CTA writes a whole partial (768 sums,
// 3 maxima, 3 sums), CTAs 0..mergers-1 wait for the row and each reads its 32-output slices
// of every partial (and the maxima and sums), warps over splits g, g + 8, ..., folds them
// through shared memory and writes the slice. The arithmetic of both steps is left out.
// kHalf: the sums as float16 (two per word; the maxima and sums stay 32-bit words), half the
// bytes.
// kMode (decomposition): 0 the whole hand-off; 1 the partials written, one merging CTA reading
// one word of each; 2 one word per partial, 24 merging CTAs reading it from every partial;
// 3 as 0 without the maxima and sums read; 4 as 0 with partials 128-byte aligned (800 words
// apart); 5 as 0 with each warp reading one partial only (a ninth of the loads).
template <int kT, bool kHalf, int kMode = 0>
__global__ void __launch_bounds__(256) probe_wide(Probe p) {
  constexpr int kSums = kHalf ? kOut / 2 : kOut;  // words of sums per partial
  constexpr int kWords = kMode == 4 ? 800 : kSums + 2 * QSA_ATTN_HEADS;
  grid_dependency_wait();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = blockIdx.x, splits = gridDim.x;
  const int mergers = kMode == 1 ? 1 : splits < kSlices ? splits : kSlices;
  const int64_t r = blockIdx.y;
  const uint32_t x = warp_tokens<kT>(p, r, (s * 8 + warp) * kT, lane, true);
  __shared__ uint32_t sh[8];
  if (lane == 0) sh[warp] = x;
  __syncthreads();
  uint32_t y = 0;
#pragma unroll
  for (int w = 0; w < 8; ++w) y ^= sh[w];
  uint32_t* mine = p.words + (r * splits + s) * kWords;
  if (kMode == 2) {
    if (tid == 0) mine[0] = y;
  } else {
    for (int o = tid; o < kSums + 2 * QSA_ATTN_HEADS; o += 256) mine[o] = y ^ o;
  }
  __syncthreads();
  int32_t* counter = p.counters + r * 32;
  const int add = s == 0 ? 1 + int(kEpoch) - splits : 1;
  if (s >= mergers) {
    if (tid == 0) qsa::detail::red_add_release_gpu(counter, add);
    allow_dependents();
    return;
  }
  if (tid == 0) {
    const uint32_t before = static_cast<uint32_t>(qsa::detail::atomic_add_acq_rel_gpu(counter, add));
    const uint32_t done = (before & ~(kEpoch - 1)) + kEpoch;
    while (static_cast<int32_t>(static_cast<uint32_t>(qsa::detail::ld_acquire_gpu(counter)) - done) < 0) {
    }
  }
  allow_dependents();
  __syncthreads();
  __shared__ uint32_t g[8][32];
  const uint32_t* row = p.words + r * splits * kWords;
  if constexpr (kMode == 1) {
    if (tid == 0) g[0][0] = 0;
    __syncthreads();
    for (int i = tid; i < splits; i += 256) atomicXor(&g[0][0], __ldcg(row + i * kWords + kSums));
    __syncthreads();
    if (tid == 0) p.out[r * kOut] = g[0][0];
    return;
  }
  for (int slice = s; slice < kSlices; slice += mergers) {
    const int o = slice * 32 + lane;
    const int h = o / QSA_HEAD_DIM;
    // every load of the slice issued before the first is used, as the kernel's merge does
    constexpr int kGroup = ((kWidth + 8 * kT - 1) / (8 * kT) + 7) / 8;
    uint32_t a[kGroup], m[kGroup], l[kGroup];
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {  // past the row's splits: split 0 again, masked below
      const int sp = warp + 8 * u;
      const uint32_t* pc = row + (sp < splits ? sp : 0) * kWords;
      if constexpr (kMode == 2) {
        a[u] = __ldcg(pc);
        m[u] = l[u] = 0;
      } else if constexpr (kMode == 3) {
        a[u] = __ldcg(pc + o);
        m[u] = l[u] = 0;
      } else if constexpr (kMode == 5) {
        a[u] = u == 0 ? __ldcg(pc + o) : 0u;
        m[u] = u == 0 ? __ldcg(pc + kSums + h) : 0u;
        l[u] = u == 0 ? __ldcg(pc + kSums + QSA_ATTN_HEADS + h) : 0u;
      } else {
        a[u] = __ldcg(pc + (kHalf ? o / 2 : o));
        m[u] = __ldcg(pc + kSums + h);
        l[u] = __ldcg(pc + kSums + QSA_ATTN_HEADS + h);
      }
    }
    // every term waits for every load (the kernel's merge does the same; without it ptxas
    // folded each split's words before issuing the next split's loads)
    const uint32_t zero = static_cast<uint32_t>(p.pages >> 62);  // pages < 2^62
    uint32_t all = 0;
#pragma unroll
    for (int u = 0; u < kGroup; ++u) all |= a[u] | m[u] | l[u];
    const uint32_t gate = all & zero;
    uint32_t z = 0;
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      z ^= warp + 8 * u < splits ? (a[u] + gate) ^ (m[u] + gate) ^ (l[u] + gate) : 0u;
    }
    g[warp][lane] = z;
    __syncthreads();
    if (tid < 32) {
      uint32_t w2 = 0;
#pragma unroll
      for (int w = 0; w < 8; ++w) w2 ^= g[w][tid];
      p.out[r * kOut + slice * 32 + tid] = w2;
    }
    __syncthreads();
  }
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(v));
  return v;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t ld_dsmem(const uint32_t* local, uint32_t rank) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(local)), remote, v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(remote) : "memory");
  return v;
}

// Clusters, then a global hand-off (grid (splits, R), clusters of kC CTAs along x, 8 warps of
// kT columns per CTA): each CTA keeps its partial (774 words) in shared memory; after a
// cluster barrier CTA `rank` gathers slice `rank` of the cluster's partial over distributed
// shared memory (every CTA of the cluster, all loads issued together) and writes it to
// global memory; after a second barrier the cluster's rank 0 releases it on the row counter.
// The row's first cluster merges: its rank 0 acquires every cluster's arrival, a third
// barrier passes that on, and each of its CTAs reads its slice of every cluster partial and
// writes its outputs. The spin is bounded (a grid that is not resident at once reports, not
// hangs): the word after the row counter is set to 1 then.
template <int kC, int kT>
__global__ void __launch_bounds__(256) probe_tree(Probe p) {
  grid_dependency_wait();
  constexpr int kWords = kOut + 2 * QSA_ATTN_HEADS;
  constexpr int kSlice = kOut / kC;  // outputs gathered per CTA
  static_assert(kOut % kC == 0 && kSlice + 2 * QSA_ATTN_HEADS <= 256, "one word per thread");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = blockIdx.x, clusters = gridDim.x / kC, cl = s / kC;
  const int rank = static_cast<int>(cluster_rank());
  const int64_t r = blockIdx.y;
  const uint32_t x = warp_tokens<kT>(p, r, (s * 8 + warp) * kT, lane, true);
  __shared__ uint32_t sh[8];
  __shared__ uint32_t part[kWords];
  if (lane == 0) sh[warp] = x;
  __syncthreads();
  uint32_t y = 0;
#pragma unroll
  for (int w = 0; w < 8; ++w) y ^= sh[w];
  for (int o = tid; o < kWords; o += 256) part[o] = y ^ o;
  cluster_sync();
  // thread t < kSlice: output rank * kSlice + t; the next 6 (rank 0 only): the maxima and sums
  const bool sums = tid < kSlice;
  const bool stats = rank == 0 && tid >= kSlice && tid < kSlice + 2 * QSA_ATTN_HEADS;
  const int w = sums ? rank * kSlice + tid : kOut + (tid - kSlice);
  uint32_t* mine = p.words + (r * clusters + cl) * kWords;
  if (sums || stats) {
    uint32_t v[kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) v[c] = ld_dsmem(&part[w], c);
    mine[w] = gated_fold<kC>(v, p);
  }
  cluster_sync();  // the cluster's partial written; no CTA leaves while its part may be read
  int32_t* counter = p.counters + r * 32;
  if (cl != 0) {
    if (rank == 0 && tid == 0) qsa::detail::red_add_release_gpu(counter, 1);
    allow_dependents();
    return;
  }
  if (rank == 0 && tid == 0) {
    const int add = 1 + int(kEpoch) - clusters;
    const uint32_t before = static_cast<uint32_t>(qsa::detail::atomic_add_acq_rel_gpu(counter, add));
    const uint32_t done = (before & ~(kEpoch - 1)) + kEpoch;
    int spins = 0;
    while (static_cast<int32_t>(static_cast<uint32_t>(qsa::detail::ld_acquire_gpu(counter)) - done) < 0 &&
           ++spins < (1 << 22)) {
    }
    if (spins >= (1 << 22)) atomicExch(counter + 1, 1);
  }
  allow_dependents();
  cluster_sync();  // rank 0's acquire passed on to the cluster
  if (sums || stats) {
    const uint32_t* row = p.words + r * clusters * kWords;
    constexpr int kMaxClusters = 16;
    uint32_t v[kMaxClusters];
#pragma unroll
    for (int c = 0; c < kMaxClusters; ++c) v[c] = c < clusters ? __ldcg(row + c * kWords + w) : 0u;
    const uint32_t z = gated_fold<kMaxClusters>(v, p);
    if (sums) p.out[r * kOut + w] = z;
  }
}

// One cluster of kC CTAs per row (grid (kC, R)), 32 warps of kT columns each.
template <int kC, int kT>
__global__ void __launch_bounds__(1024) probe_cluster(Probe p) {
  grid_dependency_wait();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = static_cast<int>(cluster_rank());
  const int64_t r = blockIdx.y;
  const uint32_t x = warp_tokens<kT>(p, r, (s * 32 + warp) * kT, lane, warp < 1);
  __shared__ uint32_t word;
  const uint32_t y = cta_fold<32>(x, tid);
  if (tid == 0) word = y;
  allow_dependents();
  cluster_sync();
  if (s == 0 && tid == 0) {
    uint32_t v[kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) v[c] = ld_dsmem(&word, c);
    p.out[r] = gated_fold<kC>(v, p);
  }
  cluster_sync();  // no CTA leaves while its word may still be read
}

// One CTA of 32 warps per row; warp w takes the kT-column chunks w, w + 32, ...
template <int kT>
__global__ void __launch_bounds__(1024) probe_single(Probe p) {
  grid_dependency_wait();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r = blockIdx.y;
  uint32_t x = 0;
  for (int c = warp * kT; c < kWidth; c += 32 * kT) x ^= warp_tokens<kT>(p, r, c, lane, c == 0);
  const uint32_t y = cta_fold<32>(x, tid);
  if (tid == 0) p.out[r] = y;
}

cudaLaunchAttribute pdl() { return qsa::detail::pdl_attribute(); }

template <typename K>
int launch(K kernel, dim3 grid, int threads, int cluster, bool cooperative, const Probe& p,
           cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[3];
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.stream = stream;
  cfg.attrs = attr;
  attr[cfg.numAttrs++] = pdl();
  if (cooperative) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeCooperative;
    attr[cfg.numAttrs++].val.cooperative = 1;
  }
  if (cluster > 1) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[cfg.numAttrs].val.clusterDim.y = 1;
    attr[cfg.numAttrs++].val.clusterDim.z = 1;
  }
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, p);
  if (err == cudaSuccess) err = cudaGetLastError();
  return static_cast<int>(err);
}

}  // namespace

// The probes by name; returns the cudaError_t of the launch (-1: unknown name).
extern "C" int floor_probe(const char* name, int64_t rows, const void* q, const void* kv,
                           const int32_t* indices, int64_t indices_stride, const int32_t* table,
                           int64_t table_stride, int64_t table_width, const int32_t* token_to_req,
                           int64_t requests, int64_t pages, uint32_t* words, int32_t* counters,
                           uint32_t* out, void* stream_ptr) {
  Probe p{static_cast<const __half*>(q), static_cast<const __half*>(kv), indices, indices_stride,
          table, table_stride, token_to_req, requests, table_width, pages, words, counters, out};
  cudaStream_t st = static_cast<cudaStream_t>(stream_ptr);
  const unsigned R = static_cast<unsigned>(rows);
  auto n = [](int cols) { return static_cast<unsigned>((kWidth + cols - 1) / cols); };
  const auto is = [name](const char* s) { return std::strcmp(name, s) == 0; };
  if (is("launch")) return launch(probe_launch, dim3(n(32), R), 256, 1, true, p, st);
  if (is("loads-65")) return launch(probe_split<8, 4, false>, dim3(n(32), R), 256, 1, true, p, st);
  if (is("loads-129")) return launch(probe_split<8, 2, false>, dim3(n(16), R), 256, 1, true, p, st);
  if (is("loads-33")) return launch(probe_split<8, 8, false>, dim3(n(64), R), 256, 1, true, p, st);
  if (is("exchange-65")) return launch(probe_split<8, 4, true>, dim3(n(32), R), 256, 1, true, p, st);
  if (is("exchange-129")) return launch(probe_split<8, 2, true>, dim3(n(16), R), 256, 1, true, p, st);
  if (is("exchange-33")) return launch(probe_split<8, 8, true>, dim3(n(64), R), 256, 1, true, p, st);
  if (is("exchange-257")) return launch(probe_split<8, 1, true>, dim3(n(8), R), 256, 1, true, p, st);
  if (is("loads-257")) return launch(probe_split<8, 1, false>, dim3(n(8), R), 256, 1, true, p, st);
  if (is("wide-33")) return launch(probe_wide<8, false>, dim3(n(64), R), 256, 1, true, p, st);
  if (is("wide-65")) return launch(probe_wide<4, false>, dim3(n(32), R), 256, 1, true, p, st);
  if (is("wide-129")) return launch(probe_wide<2, false>, dim3(n(16), R), 256, 1, true, p, st);
  if (is("wide-half-33")) return launch(probe_wide<8, true>, dim3(n(64), R), 256, 1, true, p, st);
  if (is("wide-half-65")) return launch(probe_wide<4, true>, dim3(n(32), R), 256, 1, true, p, st);
  if (is("wide-write-65")) return launch(probe_wide<4, false, 1>, dim3(n(32), R), 256, 1, true, p, st);
  if (is("wide-sums-65")) return launch(probe_wide<4, false, 3>, dim3(n(32), R), 256, 1, true, p, st);
  if (is("wide-aligned-65")) return launch(probe_wide<4, false, 4>, dim3(n(32), R), 256, 1, true, p, st);
  if (is("wide-one-65")) return launch(probe_wide<4, false, 5>, dim3(n(32), R), 256, 1, true, p, st);
  if (is("wide-poll-65")) return launch(probe_wide<4, false, 2>, dim3(n(32), R), 256, 1, true, p, st);
  if (is("tree-9x16")) return launch(probe_tree<16, 2>, dim3(144, R), 256, 16, false, p, st);
  if (is("tree-17x8")) return launch(probe_tree<8, 2>, dim3(136, R), 256, 8, false, p, st);
  if (is("tree-9x8")) return launch(probe_tree<8, 4>, dim3(72, R), 256, 8, false, p, st);
  if (is("tree-5x16")) return launch(probe_tree<16, 4>, dim3(80, R), 256, 16, false, p, st);
  if (is("cluster-8")) return launch(probe_cluster<8, 9>, dim3(8, R), 1024, 8, false, p, st);
  if (is("cluster-16")) return launch(probe_cluster<16, 5>, dim3(16, R), 1024, 16, false, p, st);
  if (is("single")) return launch(probe_single<4>, dim3(1, R), 1024, 1, false, p, st);
  return -1;
}
