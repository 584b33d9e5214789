// Fused paged token selection (contract section 1): block scores, exact top-512, expansion.
//
// Two launches per group of rows:
//   1. score_blocks_kernel  grid (chunks, rows): one half-warp per compressed key computes the
//      4-head ReLU score in float32 and stores it as an order-preserving uint32 key.
//   2. select_rows_kernel   grid (rows): one CTA per row (1024 threads; 512 when there are
//      more rows than SMs) finds the exact 512-th
//      largest key by radix select, gathers the winners in block order (ties broken by the
//      lower block index), sorts them by (score desc, block asc) and writes the row.
//
// NOTES: scores are >= 0 after ReLU, so the IEEE bit pattern of a float score orders like the
// score itself. key = bits + 1 for a usable block and 0 for an unusable one, so one unsigned
// compare ranks everything and unusable blocks can never win. -0.0 is canonicalised to +0.0
// (x > 0 ? x : 0) so that it ties with +0.0 exactly as in the reference.
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common.cuh"
#include "qsa.h"

namespace qsa {
// NOTES: a named namespace, not an anonymous one: nvcc names anonymous-namespace kernels
// after a hash of the source's absolute path, which would make the DSO depend on where it
// was built.
namespace select_impl {

using detail::half8_to_float;
using detail::load8;

constexpr int kIndexHeads = QSA_INDEX_HEADS;    // 4
constexpr int kIndexDim = QSA_INDEX_DIM;        // 128
constexpr int kCkPage = QSA_CK_PAGE;            // 128 compressed keys per page
constexpr int kRatio = QSA_COMPRESS_RATIO;      // 4 tokens per block
constexpr int kBlockTopk = QSA_BLOCK_TOPK;      // 512
constexpr int kWidth = QSA_WIDTH;               // 2051
static_assert(kIndexHeads == 4, "score reduction is written for 4 index heads");
static_assert(kIndexDim == 16 * 8, "a half-warp of 16 lanes x 8 halves covers one key");
static_assert(kBlockTopk == 512, "the bitonic sort is sized for 512 winners");
static_assert(kWidth == kBlockTopk * kRatio + QSA_TAIL, "row width");

// NOTES: 1/sqrt(128) rounded once to float32, as the reference multiplies a float32 tensor by
// the Python float 128 ** -0.5. Scaling is monotone, so it never reorders; it is applied so
// that equal scores are equal bit for bit with the reference.
constexpr float kScoreScale = static_cast<float>(0.088388347648318440550105545263);

constexpr int kScoreThreads = 256;                    // 16 half-warps
// NOTES: one page (128 blocks, 8 keys per half-warp, 32 KiB) per CTA iteration: v4's 64-block
// chunks kept 16 KiB in flight per CTA behind a 3-4 load dependent chain (2.2 TB/s at R=64).
constexpr int kScoreChunk = 128;                      // blocks per CTA iteration (8 per half-warp)
constexpr int kKeysPerHalfWarp = kScoreChunk / (kScoreThreads / 16);
static_assert(kCkPage % kScoreChunk == 0, "a chunk never straddles a page");

constexpr int kSelectWarpsMax = 32;
constexpr int64_t kPdlMaxRows = 2;   // row-select launched as a programmatic dependent  // select_rows_kernel runs 512 or 1024 threads
constexpr int kRadixBins = 2048;
constexpr int kRadixUnroll = 4;                       // keys per thread per histogram step                      // 11-bit digits: passes of 11, 11, 10 bits
// NOTES: keys of one row live in shared memory when they fit (up to 48K blocks = 196K tokens,
// 192 KiB); longer rows are read from the L2-resident workspace through the same generic
// pointer. 192 KiB + 12 KiB of fixed arrays stays under the 227 KiB opt-in limit.
constexpr int kSmemKeysCap = 48 * 1024;
// NOTES: rows are processed in groups so the score workspace stays <= 64 MiB (one 131072-token
// row needs 128 KiB; 512 such rows fit). A group never exceeds gridDim.y's limit.
constexpr size_t kWorkspaceCap = size_t(64) << 20;
constexpr int64_t kMaxGroupRows = 65535;

struct RowInfo {
  bool valid;       // token_to_req in [0, B)
  int64_t b;
  int64_t n;        // visible tokens
  int64_t nb;       // visible blocks
  int64_t nbv;      // visible blocks inside the page table (candidates)
};

__device__ __forceinline__ RowInfo row_info(const SelectParams& p, int64_t r, int64_t ncap) {
  RowInfo ri;
  const int64_t b = p.token_to_req[r];
  ri.valid = b >= 0 && b < p.requests;
  ri.b = b;
  ri.n = ri.nb = ri.nbv = 0;
  if (ri.valid) {
    const int64_t pos1 = p.query_positions[r] + 1;
    const int64_t len = p.sequence_lengths[b];
    int64_t n = pos1 < len ? pos1 : len;
    n = n > 0 ? n : 0;
    ri.n = n;
    ri.nb = n / kRatio;
    ri.nbv = ri.nb < ncap ? ri.nb : ncap;
  }
  return ri;
}

// Scores of kScoreChunk consecutive blocks per CTA iteration; keys[rl * ncap + j].
template <bool kVec16>
__global__ void __launch_bounds__(kScoreThreads)
    score_blocks_kernel(SelectParams p, int64_t row0, int64_t ncap, uint32_t* __restrict__ keys) {
  const int64_t rl = blockIdx.y;
  const int64_t r = row0 + rl;
  const int hw = threadIdx.x >> 4;   // half-warp: 0..15
  const int lane = threadIdx.x & 15; // dims [8 lane, 8 lane + 8)
  const int64_t first = int64_t(blockIdx.x) * kScoreChunk;  // < ncap = M * 128

  // NOTES: dependent chain cut from 4 loads to 3 before the keys: token_to_req, the query
  // position and q go out together; the sequence length and the first chunk's page-table
  // entry then go out together (the entry is read whether or not the chunk is visible).
  // (asm volatile loads: the compiler otherwise sinks them below the early returns.)
  const int64_t b = detail::ldg32_pred(p.token_to_req + r, true, -1);
  const int64_t pos1 = detail::ldg64(p.query_positions + r) + 1;
  const __half* q = static_cast<const __half*>(p.q) + r * (kIndexHeads * kIndexDim);
  uint4 qraw[kIndexHeads];
#pragma unroll
  for (int h = 0; h < kIndexHeads; ++h) {
    qraw[h] = detail::load8_pred<kVec16>(q + h * kIndexDim + lane * 8, true);
  }
  const bool b_ok = b >= 0 && b < p.requests;
  const int32_t* table = p.page_table + (b_ok ? b : 0) * p.page_table_stride;
  const int64_t len = detail::ldg32_pred(p.sequence_lengths + (b_ok ? b : 0), b_ok, 0);
  // (first < ncap: the table has this page; with M = 0 there is no entry to read)
  int64_t phys = detail::ldg32_pred(table + first / kCkPage, b_ok && first < ncap, -1);
  if (!b_ok) return;
  RowInfo ri;
  ri.valid = true;
  ri.b = b;
  ri.n = pos1 < len ? pos1 : len;
  ri.n = ri.n > 0 ? ri.n : 0;
  ri.nb = ri.n / kRatio;
  ri.nbv = ri.nb < ncap ? ri.nb : ncap;
  if (first >= ri.nbv) return;

  // q[r, h, 8 lane .. 8 lane + 7] for the 4 heads, in float32.
  float qf[kIndexHeads][8];
#pragma unroll
  for (int h = 0; h < kIndexHeads; ++h) half8_to_float(qraw[h], qf[h]);
  const __half* ck = static_cast<const __half*>(p.compressed_keys);
  const uint32_t zero = static_cast<uint32_t>(ncap >> 62);  // ncap < 2^62
  uint32_t* row_keys = keys + rl * ncap;
  const int64_t stride = int64_t(gridDim.x) * kScoreChunk;

  for (int64_t j0 = first; j0 < ri.nbv; j0 += stride) {
    // The next chunk's page-table entry goes out with this chunk's keys.
    const bool more = j0 + stride < ri.nbv;
    const int64_t next = detail::ldg32_pred(table + (more ? (j0 + stride) / kCkPage : 0), more, -1);
    const bool usable = phys >= 0 && phys < p.pages;
    if (!usable) {
      // Never read: an unusable block gets key 0 and can never be chosen.
      for (int i = threadIdx.x; i < kScoreChunk; i += kScoreThreads) {
        if (j0 + i < ri.nbv) row_keys[j0 + i] = 0u;
      }
      phys = next;
      continue;
    }
    // Half-warp hw takes blocks j0 + k*16 + hw: a warp reads 512 contiguous bytes per load.
    // NOTES: unpredicated loads of a clamped block (j0 < nbv, same page): the 8 loads go out
    // together. v4 zero-filled past the end with predicated loads, and ptxas sank each of
    // them to its first use (one round trip per key). A clamped key's score is not stored.
    uint4 raw[kKeysPerHalfWarp];
#pragma unroll
    for (int k = 0; k < kKeysPerHalfWarp; ++k) {
      const int64_t j = min(j0 + k * 16 + hw, ri.nbv - 1);
      const int64_t slot = phys * kCkPage + (j % kCkPage);
      raw[k] = load8<kVec16>(ck + slot * kIndexDim + lane * 8);
    }
    // NOTES: ptxas still sank loads 1..3 below key 0's arithmetic (one round trip per key):
    // key 0 is made to depend on all of them (`zero` is 0 at run time, unknown to the
    // compiler), so all loads are in flight before the first FMA.
    uint32_t later = 0;
#pragma unroll
    for (int k = 1; k < kKeysPerHalfWarp; ++k) later |= raw[k].x;
    raw[0].x |= later & zero;
#pragma unroll
    for (int k = 0; k < kKeysPerHalfWarp; ++k) {
      float kf[8];
      half8_to_float(raw[k], kf);
      float v[kIndexHeads];
#pragma unroll
      for (int h = 0; h < kIndexHeads; ++h) {
        float acc = 0.f;
#pragma unroll
        for (int d = 0; d < 8; ++d) acc = fmaf(qf[h][d], kf[d], acc);
        v[h] = acc;
      }
      // Transposed butterfly: 4 head sums over 16 lanes in 5 shuffles; afterwards lane bits
      // 3..2 name the head whose full dot product this lane holds.
      const bool hi8 = lane & 8;
      float a0 = hi8 ? v[2] : v[0];
      float a1 = hi8 ? v[3] : v[1];
      const float s0 = hi8 ? v[0] : v[2];
      const float s1 = hi8 ? v[1] : v[3];
      a0 += __shfl_xor_sync(0xffffffffu, s0, 8);
      a1 += __shfl_xor_sync(0xffffffffu, s1, 8);
      const bool hi4 = lane & 4;
      float c = hi4 ? a1 : a0;
      const float s = hi4 ? a0 : a1;
      c += __shfl_xor_sync(0xffffffffu, s, 4);
      c += __shfl_xor_sync(0xffffffffu, c, 2);
      c += __shfl_xor_sync(0xffffffffu, c, 1);
      c = c > 0.f ? c : 0.f;  // ReLU; also maps -0.0 to +0.0
      c += __shfl_xor_sync(0xffffffffu, c, 4);
      c += __shfl_xor_sync(0xffffffffu, c, 8);
      const int64_t j = j0 + k * 16 + hw;
      if (lane == 0 && j < ri.nbv) row_keys[j] = __float_as_uint(c * kScoreScale) + 1u;
    }
    phys = next;
  }
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // after the last store
}

struct SelectShared {
  uint32_t hist[kRadixBins];
  unsigned long long winners[kBlockTopk];
  int warp_gt[kSelectWarpsMax];
  int warp_eq[kSelectWarpsMax];
  int warp_eq_base[kSelectWarpsMax];
  int warp_out_base[kSelectWarpsMax];
  int scan[kSelectWarpsMax];
  uint32_t digit;
  int above;
  int digit_count;
  int chosen;
};

// Inclusive block scan of one int per thread (kT threads, at most 1024).
template <int kT>
__device__ __forceinline__ int block_inclusive_scan(int x, int* warp_sums) {
  constexpr int kW = kT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kW ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kW) warp_sums[lane] = w;
  }
  __syncthreads();
  const int res = x + (warp > 0 ? warp_sums[warp - 1] : 0);
  __syncthreads();  // warp_sums is reused by the caller's next scan
  return res;
}

// kT threads per CTA: 1024 while the rows fit on the SMs in one wave, 512 for larger batches
// (several rows per SM; the phases of one row are latency-bound).
template <int kT>
__global__ void __launch_bounds__(kT, 1024 / kT)
    select_rows_kernel(SelectParams p, int64_t row0, int64_t ncap, const uint32_t* __restrict__ keys) {
  constexpr int kSelectThreads = kT;
  constexpr int kSelectWarps = kT / 32;
  constexpr int kBinsPer = kRadixBins / kT;
  extern __shared__ uint4 dyn_smem[];
  __shared__ SelectShared sh;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r = row0 + blockIdx.x;
  int32_t* out = p.out + r * p.out_stride;
  const RowInfo ri = row_info(p, r, ncap);
  // NOTES: small batches launch this kernel as a programmatic dependent of the score kernel
  // (PDL): the launch and row_info's 3 dependent loads (inputs the score kernel does not
  // write) overlap the score kernel; nothing is written and no key is read before the wait.
  // Without the launch attribute the wait returns at once.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (!ri.valid) {
    for (int c = tid; c < kWidth; c += kSelectThreads) out[c] = -1;
    return;
  }
  const int nbv = static_cast<int>(ri.nbv);  // <= M*128 candidate blocks
  const uint32_t* row_keys = keys + int64_t(blockIdx.x) * ncap;

  // Stage the keys in shared memory when they fit; otherwise read them from L2.
  const uint32_t* K = row_keys;
  if (nbv <= kSmemKeysCap) {
    uint32_t* sk = reinterpret_cast<uint32_t*>(dyn_smem);
    const int n4 = nbv / 4;  // rows start 16-byte aligned: ncap is a multiple of 128
    const uint4* src4 = reinterpret_cast<const uint4*>(row_keys);
#pragma unroll 4
    for (int i = tid; i < n4; i += kSelectThreads) reinterpret_cast<uint4*>(sk)[i] = src4[i];
    for (int i = n4 * 4 + tid; i < nbv; i += kSelectThreads) sk[i] = row_keys[i];
    K = sk;
  }
  __syncthreads();

  // ---- Radix select: the exact kBlockTopk-th largest key (prefix under mask) ----------------
  uint32_t prefix = 0, mask = 0xffffffffu;
  int k_rem = 0;  // with nbv <= 512 every usable block wins: chosen = key > 0
  if (nbv > kBlockTopk) {
    mask = 0;
    k_rem = kBlockTopk;
    const int shifts[3] = {21, 10, 0};
    const int bits[3] = {11, 11, 10};
    for (int pass = 0; pass < 3; ++pass) {
      const int shift = shifts[pass];
      const uint32_t nbins = 1u << bits[pass];
      for (int i = tid; i < kRadixBins; i += kSelectThreads) sh.hist[i] = 0;
      __syncthreads();
      // NOTES: 4 keys per thread per step, as independent chains (load, vote, atomic): one key
      // per step left each warp waiting ~150 cycles per key (v2: 25 us for 32K keys).
      for (int base = 0; base < nbv; base += kRadixUnroll * kSelectThreads) {
        uint32_t d[kRadixUnroll];
#pragma unroll
        for (int u = 0; u < kRadixUnroll; ++u) {
          const int j = base + u * kSelectThreads + tid;
          d[u] = 0xffffffffu;  // sentinel: no bin
          if (j < nbv) {
            const uint32_t key = K[j];
            if ((key & mask) == prefix) d[u] = (key >> shift) & (nbins - 1);
          }
        }
        // NOTES: ReLU makes many keys equal (0.0 -> key 1): when the whole warp holds one
        // digit, one lane adds for all (a 32-way shared-atomic conflict otherwise). Mixed
        // warps add lane by lane; __match_any_sync would aggregate those too, but it costs
        // more than the conflicts it saves on distinct scores.
#pragma unroll
        for (int u = 0; u < kRadixUnroll; ++u) {
          const uint32_t d0 = __shfl_sync(0xffffffffu, d[u], 0);
          if (__all_sync(0xffffffffu, d[u] == d0)) {
            if (lane == 0 && d0 != 0xffffffffu) atomicAdd(&sh.hist[d0], 32u);
          } else if (d[u] != 0xffffffffu) {
            atomicAdd(&sh.hist[d[u]], 1u);
          }
        }
      }
      __syncthreads();
      // Scan the bins from the top: thread t owns bins nbins-1-kBinsPer*t-j, j < kBinsPer.
      int cnt[kBinsPer];
      int sum = 0;
#pragma unroll
      for (int j = 0; j < kBinsPer; ++j) {
        const int bj = int(nbins) - 1 - kBinsPer * tid - j;
        cnt[j] = bj >= 0 ? int(sh.hist[bj]) : 0;
        sum += cnt[j];
      }
      const int incl = block_inclusive_scan<kT>(sum, sh.scan);
      int run = incl - sum;
#pragma unroll
      for (int j = 0; j < kBinsPer; ++j) {
        if (run < k_rem && k_rem <= run + cnt[j]) {
          sh.digit = int(nbins) - 1 - kBinsPer * tid - j;
          sh.above = run;
          sh.digit_count = cnt[j];
        }
        run += cnt[j];
      }
      __syncthreads();
      k_rem -= sh.above;
      prefix |= sh.digit << shift;
      mask |= (nbins - 1) << shift;
      const bool whole_bin = sh.digit_count == k_rem;
      __syncthreads();
      if (whole_bin) break;  // every key of this bin wins: no need to refine
    }
  }

  // ---- Gather winners in block order: warp w owns a contiguous segment -------------------
  // chosen = usable && (masked key above the threshold, or on it with tie rank < k_rem).
  const int seg = ((nbv + kSelectWarps * 32 - 1) / (kSelectWarps * 32)) * 32;
  const int seg_lo = warp * seg;
  const int seg_hi = min(seg_lo + seg, nbv);
  int gt = 0, eq = 0;
#pragma unroll 4
  for (int j0 = seg_lo; j0 < seg_hi; j0 += 32) {
    const int j = j0 + lane;
    uint32_t key = 0;
    if (j < seg_hi) key = K[j];
    const uint32_t mk = key & mask;
    gt += __popc(__ballot_sync(0xffffffffu, key != 0 && mk > prefix));
    eq += __popc(__ballot_sync(0xffffffffu, key != 0 && mk == prefix));
  }
  if (lane == 0) {
    sh.warp_gt[warp] = gt;
    sh.warp_eq[warp] = eq;
  }
  __syncthreads();
  if (warp == 0) {
    int e = lane < kSelectWarps ? sh.warp_eq[lane] : 0;
    int e_incl = e;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, e_incl, o);
      if (lane >= o) e_incl += y;
    }
    const int e_base = e_incl - e;
    const int take_eq = max(0, min(k_rem - e_base, e));
    const int c = (lane < kSelectWarps ? sh.warp_gt[lane] : 0) + take_eq;
    int c_incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, c_incl, o);
      if (lane >= o) c_incl += y;
    }
    if (lane < kSelectWarps) {
      sh.warp_eq_base[lane] = e_base;
      sh.warp_out_base[lane] = c_incl - c;
    }
    if (lane == 31) sh.chosen = c_incl;
  }
  __syncthreads();
  const int kb = sh.chosen;  // = min(512, usable blocks)
  {
    int eq_seen = sh.warp_eq_base[warp];
    int pos = sh.warp_out_base[warp];
    const unsigned lt = (1u << lane) - 1u;
#pragma unroll 4
    for (int j0 = seg_lo; j0 < seg_hi; j0 += 32) {
      const int j = j0 + lane;
      uint32_t key = 0;
      if (j < seg_hi) key = K[j];
      const uint32_t mk = key & mask;
      const bool is_gt = key != 0 && mk > prefix;
      const bool is_eq = key != 0 && mk == prefix;
      const unsigned eq_bits = __ballot_sync(0xffffffffu, is_eq);
      const bool chosen = is_gt || (is_eq && eq_seen + __popc(eq_bits & lt) < k_rem);
      const unsigned ch_bits = __ballot_sync(0xffffffffu, chosen);
      if (chosen) {
        // Descending order of (key, ~j) = score descending, lower block first on ties.
        sh.winners[pos + __popc(ch_bits & lt)] =
            (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(j));
      }
      eq_seen += __popc(eq_bits);
      pos += __popc(ch_bits);
    }
  }
  for (int i = kb + tid; i < kBlockTopk; i += kSelectThreads) sh.winners[i] = 0ull;
  __syncthreads();

  // ---- Bitonic sort of the 512 winners, descending ---------------------------------------
  // NOTES: 256 threads each own one pair per stage; for strides <= 32 a warp's pairs stay
  // inside its own 64 elements, so those stages need only __syncwarp (6 block barriers
  // instead of 45).
  if (kb > 1) {
    bool cross_warp_before = true;  // the gather above wrote across warps
    for (int size = 2; size <= kBlockTopk; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        const bool cross_warp = stride > 32;
        if (cross_warp || cross_warp_before) {
          __syncthreads();
        } else {
          __syncwarp();
        }
        cross_warp_before = cross_warp;
        if (tid < kBlockTopk / 2) {
          const int i = 2 * tid - (tid & (stride - 1));  // lower index of the pair
          const int k = i + stride;
          const unsigned long long a = sh.winners[i], b = sh.winners[k];
          const bool descending = (i & size) == 0;
          if ((a < b) == descending) {
            sh.winners[i] = b;
            sh.winners[k] = a;
          }
        }
      }
    }
  }
  __syncthreads();

  // ---- Expansion, tail, padding -----------------------------------------------------------
  const int expanded = kb * kRatio;
  const int tail = static_cast<int>(ri.n - ri.nb * kRatio);
  const int64_t tail_first = ri.nb * kRatio;
  for (int c = tid; c < kWidth; c += kSelectThreads) {
    int32_t v = -1;
    if (c < expanded) {
      const uint32_t j = 0xffffffffu - static_cast<uint32_t>(sh.winners[c / kRatio]);
      v = static_cast<int32_t>(int64_t(j) * kRatio + (c % kRatio));
    } else if (c < expanded + tail) {
      v = static_cast<int32_t>(tail_first + (c - expanded));
    }
    out[c] = v;
  }
}

int64_t candidate_blocks(int64_t table_width) { return table_width * kCkPage; }

int64_t group_rows(int64_t rows, int64_t table_width) {
  const int64_t per_row = std::max<int64_t>(candidate_blocks(table_width), 1) * 4;
  int64_t g = static_cast<int64_t>(kWorkspaceCap / static_cast<size_t>(per_row));
  g = std::max<int64_t>(g, 1);
  g = std::min<int64_t>(g, kMaxGroupRows);
  return std::min<int64_t>(g, std::max<int64_t>(rows, 1));
}

int sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
  return sms > 0 ? sms : 132;
}

// Raise select_rows_kernel's dynamic shared-memory limit once per device (a function
// attribute, not a stream operation: allowed during graph capture).
cudaError_t raise_smem_limit() {
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(select_rows_kernel<1024>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kSmemKeysCap * sizeof(uint32_t)));
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(select_rows_kernel<512>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(kSmemKeysCap * sizeof(uint32_t)));
  }
  if (err == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

}  // namespace select_impl

using namespace select_impl;

size_t select_workspace_bytes(int64_t rows, int64_t table_width) {
  if (rows <= 0 || table_width <= 0) return 0;
  return static_cast<size_t>(group_rows(rows, table_width)) *
         static_cast<size_t>(candidate_blocks(table_width)) * sizeof(uint32_t);
}

int64_t select_launch_count(int64_t rows, int64_t table_width) {
  if (rows <= 0) return 0;
  const int64_t g = group_rows(rows, table_width);
  return 2 * ((rows + g - 1) / g);
}

cudaError_t select_paged_tokens(const SelectParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  const int64_t ncap = candidate_blocks(p.table_width);
  const size_t smem_keys =
      static_cast<size_t>(std::min<int64_t>(ncap, kSmemKeysCap)) * sizeof(uint32_t);
  cudaError_t err = raise_smem_limit();
  if (err != cudaSuccess) return err;
  if (p.workspace_bytes < select_workspace_bytes(p.rows, p.table_width)) {
    return cudaErrorInvalidValue;
  }
  uint32_t* keys = static_cast<uint32_t*>(p.workspace);
  const bool vec16 = detail::aligned16(p.q) && detail::aligned16(p.compressed_keys);
  const int64_t g = group_rows(p.rows, p.table_width);
  const int64_t chunks = std::max<int64_t>(1, (ncap + kScoreChunk - 1) / kScoreChunk);
  for (int64_t row0 = 0; row0 < p.rows; row0 += g) {
    const int64_t n = std::min<int64_t>(g, p.rows - row0);
    // NOTES: up to 128 CTAs per row (one page each up to 64K tokens: v1 looped 14 chunks per
    // CTA at R=64 and reached 1.9 TB/s, each chunk waiting on its page-table load) and at
    // least 4 CTAs per SM in total; CTAs loop over the remaining pages (the next page-table
    // entry loads with the current keys), so the grid does not grow with the page-table width
    // (M = 8192 would launch 8K CTAs per row).
    const int64_t per_row =
        std::max<int64_t>(128, (4 * int64_t(sm_count()) + n - 1) / n);
    const dim3 score_grid(static_cast<unsigned>(std::min(chunks, per_row)),
                          static_cast<unsigned>(n));
    if (vec16) {
      score_blocks_kernel<true><<<score_grid, kScoreThreads, 0, stream>>>(p, row0, ncap, keys);
    } else {
      score_blocks_kernel<false><<<score_grid, kScoreThreads, 0, stream>>>(p, row0, ncap, keys);
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    // NOTES: more rows than SMs: 512-thread CTAs, 2 per SM, all rows of a 256-row batch
    // resident at once (1024-thread CTAs ran in 2 waves there). PDL only for <= 2 rows: v5
    // launched every batch that way and lost 3-5 us at R = 8..64, the early select CTAs
    // sitting on SMs the score kernel still needed.
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(n));
    cfg.dynamicSmemBytes = smem_keys;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    if (n <= kPdlMaxRows) {
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
    }
    if (n > sm_count()) {
      cfg.blockDim = dim3(512);
      err = cudaLaunchKernelEx(&cfg, select_rows_kernel<512>, p, row0, ncap,
                               static_cast<const uint32_t*>(keys));
    } else {
      cfg.blockDim = dim3(1024);
      err = cudaLaunchKernelEx(&cfg, select_rows_kernel<1024>, p, row0, ncap,
                               static_cast<const uint32_t*>(keys));
    }
    if (err != cudaSuccess) return err;
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace qsa
