// Fused paged token selection (contract section 1): block scores, exact top-512, expansion.
//
// One launch per group of rows, grid (CTAs per row, rows), 512 threads, one CTA per SM (float8
// keys, rows outnumbering the SMs: 256 threads, two CTAs per SM, v49):
//   * every CTA scores blocks of its row, 16 per warp at a time (tensor-core mma: 16 keys x 4
//     heads per warp and m16n8k16 step, float32 accumulation): a page per group of 8 warps,
//     or, for a short row spread over more CTAs than it has pages, 16-block chunks dealt to
//     the warps across the CTAs; it stores each block's score as an order-preserving uint32
//     key in the workspace;
//   * a row of few blocks for its CTAs, in a launch of at most 4 rows, is selected by all of its
//     CTAs at once (the pairs select, kPairsMaxRows): once every CTA has stored its keys, each
//     ranks its share of the blocks against all of the row's keys and writes the chosen ones
//     at their rank;
//   * otherwise the CTA that arrives last at its row's counter selects the row: a 4096-bin
//     histogram of the keys (bins relative to the row's largest key: the last CTA takes it
//     from the keys it loads, or, in a launch with streamed rows, every CTA folds its own into
//     one atomicMax before it arrives) gives the bin of the 512-th largest; every key at or above
//     that bin goes to a shared buffer at its bin's offset (bins descending), and each key's
//     place inside its bin is its rank by (key desc, block asc), counted against its bin
//     mates; the place is the output column. Rows whose bins hold too many equal keys (mass
//     ties) take the generic path: an exact 3-pass radix select, an ordered gather and a
//     bitonic sort.
//
// NOTES: scores are >= 0 after ReLU, so the IEEE bit pattern of a float score orders like the
// score itself. key = bits + 1 for a usable block and 0 for an unusable one, so one unsigned
// compare ranks everything and unusable blocks can never win. -0.0 is canonicalised to +0.0
// (x > 0 ? x : 0) so that it ties with +0.0 exactly as in the reference. Keys are < 2^31
// (the largest is +inf's bits + 1).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "qsa.h"

// Key chunks in flight per warp with float8 keys and one page per chunk (v38: 4; v32: 3; v31:
// 4; 2 before; one less where each lane looks up its own pages).
// Independent accumulator chains of a chunk's scores (v33: 1, 2 or 4).
#ifndef QSA_SELECT_CHAINS
#define QSA_SELECT_CHAINS 2
#endif
#ifndef QSA_SELECT_FP8_DEPTH
#define QSA_SELECT_FP8_DEPTH 4
#endif
// QSA_SELECT_FLAT (v44): the lean loop's chunk step without branches: 2 (adopted) in launches
// without streamed rows, 1 in every launch, 0 in none.
#ifndef QSA_SELECT_FLAT
#define QSA_SELECT_FLAT 2
#endif

namespace qsa {
// NOTES: a named namespace, not an anonymous one: nvcc names anonymous-namespace kernels
// after a hash of the source's absolute path, which would make the DSO depend on where it
// was built.
namespace select_impl {

using detail::atomic_add_acq_rel_gpu;
using detail::Elem;
using detail::mma_16816;
using detail::word;

constexpr int kIndexHeads = QSA_INDEX_HEADS;    // 4
constexpr int kIndexDim = QSA_INDEX_DIM;        // 128
constexpr int kRatio = QSA_COMPRESS_RATIO;      // 4 tokens per block
constexpr int kBlockTopk = QSA_BLOCK_TOPK;      // 512
constexpr int kWidth = QSA_WIDTH;               // 2051
static_assert(kIndexHeads == 4, "the mma's 8 columns hold the 4 index heads (4 are zero)");
static_assert(kIndexDim == 128, "a lane's 4 x 16-byte loads cover one key in 4 lanes");
static_assert(kBlockTopk == 512, "the generic path's bitonic sort is sized for 512 winners");
static_assert(kWidth == kBlockTopk * kRatio + QSA_TAIL, "row width");

// NOTES: 1/sqrt(128) rounded once to float32, as the reference multiplies a float32 tensor by
// the Python float 128 ** -0.5. Scaling is monotone, so it never reorders; it is applied so
// that equal scores are equal bit for bit with the reference.
constexpr float kScoreScale = static_cast<float>(0.088388347648318440550105545263);

constexpr int kMaxWarps = 16;                  // 16 warps per SM: one CTA of 512 or two of 256
constexpr int kGroupThreads = 256;             // a page group: 8 warps x 16 blocks = one page
constexpr int kWarpChunk = 16;                 // blocks a warp scores at a time (mma rows)
constexpr int kScoreChunk = kWarpChunk * (kGroupThreads / 32);  // blocks per group iteration
// NOTES (contract v2): a page holds C keys (any C >= 1). A group iteration scores kScoreChunk
// consecutive blocks (one seed page); a warp's 16-block chunk lies in one page when C is a
// multiple of 16 (one page-table entry per chunk, as in the seed), else each lane looks up
// the pages of its own two blocks. NOTES (v38): with C >= kPaddedPageMin the chunks are
// dealt over padded pages instead (page_chunks): Cp = C rounded up to 16 slots per page, the
// slots past C scored by no one, so that a chunk lies in one page for vLLM's C = 196, 200, 392
// (pages of 784, 800, 1568 tokens) too, at most 15 / C of the chunks' rows idle.
#ifndef QSA_PADDED_PAGE_MIN
#define QSA_PADDED_PAGE_MIN 128
#endif
constexpr int64_t kPaddedPageMin = QSA_PADDED_PAGE_MIN;
__host__ __device__ constexpr bool page_chunks(int64_t c) {
  return c % kWarpChunk == 0 || c >= kPaddedPageMin;
}
__host__ __device__ constexpr int64_t padded_page(int64_t c) {
  return page_chunks(c) ? (c + kWarpChunk - 1) / kWarpChunk * kWarpChunk : c;
}

// NOTES (v7i): the first digit is relative to the row's largest key: bin 4095 holds the keys
// whose bits >> 15 equal the largest key's, each bin below one step (2^15 key units, 256 bins
// per octave) lower, 16 octaves in all; keys further down share bin 0. The digit is monotone
// in the key, so bins still partition the keys in order, and the place inside a bin is its
// rank by the full (key, block), so bin 0's clamping changes only how much work a row takes
// (a row whose 512-th key is in bin 0 has > 1024 keys there and takes the generic path).
// Absolute 16-per-octave bins held 60-300 keys each around the 512-th key, and the rank loop
// walks a key's whole bin.
constexpr int kDigitShift = 15;
constexpr int kDigitBins = 4096;
constexpr int kBufCap = 1024;                  // keys at or above the threshold bin (fast path)
constexpr int kRankWorkCap = 1 << 18;          // sum over those bins of count^2 (fast path)
constexpr int kRadixBins = 2048;               // generic path: 11-bit digits (11, 11, 10)
constexpr int kRadixUnroll = 4;
constexpr int kTile = 16384;                   // blocks of a resident tile (the 512-thread CTA's)
constexpr int kPairsSlots = 2;                 // tile slots of keys per thread (pairs select)

// The CTA's shape (v49): 512 threads, one CTA per SM, or 256, two per SM (the same 16 warps).
template <int kThreads_>
struct Shape {
  static constexpr int kThreads = kThreads_;
  static_assert(kThreads == 512 || kThreads == 256, "512 or 256 threads per CTA");
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kCtasPerSm = kMaxWarps / kWarps;
  static constexpr int kGroups = kThreads / kGroupThreads;
  // A thread's histogram bins: whole 16-byte words of shared memory.
  static constexpr int kBinsPerThread = kDigitBins / kThreads;
  static constexpr int kBinWords = kBinsPerThread / 4;
  static_assert(kBinsPerThread % 4 == 0, "a thread's bins are whole 16-byte words");
  static_assert(uint64_t(kWarps) * 32 * (kRankWorkCap + 1) < (uint64_t(1) << 32),
                "the saturated rank work of the CTA fits 32 bits");
  static_assert(uint64_t(kBinsPerThread) * (kBufCap + 1) * (kBufCap + 1) < (uint64_t(1) << 32),
                "a thread's clamped rank work fits 32 bits");
  // 16-byte key loads per thread of a resident tile (kTile blocks); a launch with streamed rows
  // keeps 8 (16 spill at 256 threads): its rows of at most 8 slots' blocks stay resident.
  static constexpr int kSlots = kTile / (4 * kThreads);
  static constexpr int kStreamSlots = 8;
  static constexpr int kPairsMaxBlocks = kPairsSlots * kThreads * 4;  // 4096 at 512 threads
};
constexpr int kWideCtas = 4;                   // CTAs per row when rows outnumber the SMs (512
                                               // threads; twice as many of 256, v49)
// QSA_SELECT_SOLO (v57): a row of one CTA selects without the arrival's atomic.
#ifndef QSA_SELECT_SOLO
#define QSA_SELECT_SOLO 1
#endif
// QSA_SELECT_ONE_WAVE (v57): rows that fit the launch's CTA slots once (256-thread float8
// CTAs, two per SM) take one CTA each, every row resident at once; 0: the wide count.
#ifndef QSA_SELECT_ONE_WAVE
#define QSA_SELECT_ONE_WAVE 1
#endif
#ifndef QSA_SELECT_WIDE_FP8
#define QSA_SELECT_WIDE_FP8 2
#endif
constexpr int kWideCtasFp8 = QSA_SELECT_WIDE_FP8;  // the same with float8 keys (v32)
// NOTES (v7p): in a launch whose table can hold more than kTile blocks (a streamed row) and
// whose grid is resident at once (cooperative, at most kDistRows rows), every CTA of a row
// takes part in the select: once all have scored (the row's largest key known), each
// histograms its own keys into the row's global histogram; once all have added theirs, each
// finds the threshold bin from it and pushes its own keys at or above it into the row's
// global buffer at its bin's place; the last to arrive ranks the buffer and writes the row.
// A single CTA passing over a streamed row's keys twice took ~4.2 us per pass at 32K blocks.
// Only where each page group of a CTA owns at most kDistPages pages: its own keys are read
// back one page per iteration (R = 1 at 128K, ~1 page per group: 15.25 -> 13.5 us; R = 8,
// 8 pages per group: 30.0 -> 32.5 us).
// NOTES: the workspace holds kDistRows rows' histograms and buffers (40 KiB each), and a
// launch takes the distributed select only with at most that many rows. A streamed row has
// more than kTile / 128 = 128 seed pages and needs at least 129 / (kDistPages kGroups), i.e.
// 33 CTAs, of at most SMs / rows per row: rows <= SMs / 33, 4 on 132 SMs; 8 covers devices of
// up to 296 SMs (a launch with more rows takes the last-CTA select). It was min(group rows,
// 256): up to 10 MiB of workspace that no launch could use.
constexpr int kDistRows = 8;
constexpr int64_t kDistPages = 2;
constexpr int kDistWords = 2 * kDigitBins + 2 * kBufCap;  // histogram, cursors, buffer

// NOTES: rows are processed in groups so the score workspace stays <= 64 MiB (one 131072-token
// row needs 128 KiB; 512 such rows fit). A group never has more rows than counters.
constexpr size_t kWorkspaceCap = size_t(64) << 20;
constexpr int64_t kCounterSlots = 8192;        // one arrival counter per row of a group
// counters[kCounterSlots + rl]: in a launch with streamed rows, the row's largest key (atomicMax
// of every CTA's before it arrives), read and reset to 0 by the row's last CTA.
constexpr int64_t kMaxKeySlot = kCounterSlots;

// NOTES (v27): the pairs select. In a launch of at most kPairsMaxRows rows without streamed
// rows whose grid is resident at once (cooperative), a row of few blocks for its CTAs
// (nbv <= kPairsMaxBlocks and ceil(nbv / CTAs) * nbv <= kPairsWork) is selected by all of its
// CTAs together: each arrives on the row's epoch counter once its keys are stored and waits
// for the others, loads all of the row's keys (4 blocks per thread and tile slot) and ranks
// its share of the blocks (kc = ceil(nbv / CTAs) consecutive blocks per CTA) against them.
// A block's rank by (key desc, block asc) is its place in the row, so a block ranked below
// 512 writes its 4 tokens there: no histogram, scan, buffer or last CTA. The row's last CTA
// writes the tail and the padding. Its counters are epoch counters (never reset), in slots of
// their own after the largest keys'. P8192 at R = 1 (2,303 blocks, 132 CTAs): 5.92-6.04 us
// against the last-CTA select's 6.27-6.37 in the same runs (NOTES v27).
constexpr int kPairsMaxRows = 4;
constexpr int64_t kPairsWork = int64_t(1) << 16;        // compares per CTA at most
constexpr uint32_t kPairsEpoch = 1u << 16;              // added to a row counter per call
constexpr int kPairsSpread = 32;                        // row counters 128 bytes apart
constexpr int64_t kPairsSlot = 2 * kCounterSlots;
static_assert(int64_t(kDigitBins) * kDigitBins >= kPairsWork,
              "a share (kc <= sqrt(kPairsWork) blocks) fits the histogram's shared words");
static_assert((kPairsEpoch & (kPairsEpoch - 1)) == 0, "epochs divide 2^32");

// A plain 32-bit global store through a pointer the compiler cannot see through (v40).
__device__ __forceinline__ void st_global32(uint32_t* p, uint32_t v) {
  asm volatile("st.global.u32 [%0], %1;\n" ::"l"(p), "r"(v));
}

// The same, predicated (v44).
__device__ __forceinline__ void st_global32_pred(uint32_t* p, uint32_t v, bool pred) {
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q st.global.u32 [%0], %1;\n\t}"
               ::"l"(p), "r"(v), "r"(int(pred)));
}

// The first digit of key (> 0) in a row whose largest key is maxkey.
__device__ __forceinline__ uint32_t first_digit(uint32_t key, uint32_t top) {
  const int d = int(key >> kDigitShift) - int(top) + (kDigitBins - 1);  // top = maxkey >> shift
  return static_cast<uint32_t>(d > 0 ? d : 0);
}

struct FastShared {
  alignas(16) uint32_t start[kDigitBins];   // histogram, then each bin's first buffer slot
  alignas(16) uint32_t cursor[kDigitBins];  // each bin's next free slot, then its end
  unsigned long long buf[kBufCap];
};
struct GenericShared {
  uint32_t hist[kRadixBins];
  unsigned long long winners[kBlockTopk];
};
struct SelectShared {
  union {
    FastShared f;
    GenericShared g;
  } u;
  int warp_gt[kMaxWarps];
  int warp_eq[kMaxWarps];
  int warp_eq_base[kMaxWarps];
  int warp_out_base[kMaxWarps];
  int scan[32];
  uint32_t digit;
  uint32_t maxkey;
  int above;
  int digit_count;
  int chosen;
  int usable;
  uint32_t work;  // the fast path's rank work, saturated (see the scan)
  int is_last;
};

// Division by C (runtime): j / C = (j * mul) >> shift for 0 <= j < 2^31.
struct KeyDiv {
  uint64_t mul;
  uint32_t shift;
  uint32_t d;
  __device__ __forceinline__ int64_t div(int64_t j) const {
    return static_cast<int64_t>((static_cast<uint64_t>(j) * mul) >> shift);
  }
  // The same for j < 2^31 (mul < 2^32 for d <= 2^30): one 32 x 32 -> 64 multiply.
  __device__ __forceinline__ uint32_t div32(uint32_t j) const {
    return static_cast<uint32_t>((uint64_t(j) * static_cast<uint32_t>(mul)) >> shift);
  }
};
inline KeyDiv make_key_div(int64_t d) {
  uint32_t l = 0;
  while ((int64_t(1) << l) < d) ++l;
  KeyDiv kd;
  kd.shift = 31 + l;
  kd.mul = static_cast<uint64_t>(((unsigned __int128)1 << kd.shift) / uint64_t(d)) + 1;
  kd.d = static_cast<uint32_t>(d);
  return kd;
}

// 16 bytes at any byte address, coherent (a kernel's first loads): one 16-byte load where the
// address allows it (vec16, uniform), else 16 byte loads.
__device__ __forceinline__ uint4 load16_first_any(const void* p, bool vec16, bool pred) {
  if (vec16) return detail::ldg16_pred<true>(p, pred);
  uint32_t w[4] = {0, 0, 0, 0};
  if (pred) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      uint32_t v;
      asm volatile("ld.global.u8 %0, [%1];\n" : "=r"(v) : "l"(b + i));
      w[i / 4] |= (v & 0xffu) << (8 * (i % 4));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The key loads of one block row for a lane: kLoads 16-byte words (4 of 8 fp16/bf16 dims, or
// 2 of 16 fp8 dims), and their mma A words (4 x 8 halves) after widening.
template <typename T>
constexpr int key_loads() {
  return Elem<T>::kBytes == 2 ? 4 : 2;
}
// Element offset of load s of lane t's dims: 2-byte types 8 (4 s + t) (the seed's), fp8
// 16 (4 s + t). Slot s' = 2 s + e of fp8 holds dims 16 (4 s + t) + 8 e .. + 8 after widening;
// q is loaded and widened the same way, so the mma's k order is a permutation of the dims
// shared by q and the keys.
template <typename T>
__device__ __forceinline__ int dim_offset(int s, int t) {
  return Elem<T>::kBytes == 2 ? 8 * (4 * s + t) : 16 * (4 * s + t);
}
template <typename T>
__device__ __forceinline__ void widen(const uint4 (&raw)[key_loads<T>()], uint4 (&h)[4]) {
  if constexpr (Elem<T>::kBytes == 2) {
#pragma unroll
    for (int s = 0; s < 4; ++s) h[s] = raw[s];
  } else {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      h[2 * s] = detail::fp8x8_to_half8(make_uint2(raw[s].x, raw[s].y));
      h[2 * s + 1] = detail::fp8x8_to_half8(make_uint2(raw[s].z, raw[s].w));
    }
  }
}

// Inclusive block scan of one non-negative int per thread (kThreads threads), with one barrier
// and none at the end: warp_sums must not be written again before the caller's next barrier
// (both callers pass barriers before their next scan). NOTES (v22): each warp publishes its
// total (one REDUX) before the barrier and scans its lanes beside it; after the barrier every
// warp adds the totals of the warps below it, one shared load per lane and one REDUX, instead
// of warp 0 scanning the totals between two more barriers.
__device__ __forceinline__ int block_inclusive_scan(int x, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t total = __reduce_add_sync(0xffffffffu, static_cast<uint32_t>(x));
  if (lane == 0) warp_sums[warp] = static_cast<int>(total);
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  const uint32_t below = lane < warp ? static_cast<uint32_t>(warp_sums[lane]) : 0u;
  return x + static_cast<int>(__reduce_add_sync(0xffffffffu, below));
}

// A tile of a row's keys: thread t holds blocks base + (u * kThreads + t) * 4 + (0..3), u < 8
// (keys written by other CTAs of this launch: read through L2). Missing blocks read as 0.

// A launch whose table can hold more than kTile blocks: its rows may be streamed.
__host__ __device__ constexpr bool streamed_launch(int64_t ncap) { return ncap > kTile; }

// The words of a row's keys in the workspace: its candidate blocks rounded up to 4, so that
// every row starts 16-byte aligned (load_tile reads 4 keys per load) for any M * C (C = 129,
// say, a page of 516 tokens).
__host__ __device__ constexpr int64_t key_stride(int64_t ncap) {
  return (ncap + 3) & ~int64_t(3);
}

// kBounded: skip the slot rows past the row's blocks (all zero), for a resident tile.
// NOTES: the visits' unrolled bodies are ~25 KB of the kernel's code and the last CTA runs
// them once, so the time of a short row went to instruction fetch (ncu: `no_inst` stalls at
// the visits' lines): stopping at the row's end took P8192 from 9.3 to 8.4 us. On streamed
// tiles the same branches cost 1 us at 128K (32K blocks), so they are not taken there.
template <int kThreads, bool kBounded, int kN>
__device__ __forceinline__ void load_tile(const uint32_t* keys, int nbv, int base,
                                          uint4 (&v)[kN]) {
  const uint4* k4 = reinterpret_cast<const uint4*>(keys);  // rows start 16-byte aligned
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    if constexpr (kBounded) {
      if (base + u * kThreads * 4 >= nbv) {  // uniform over the CTA
        v[u] = make_uint4(0, 0, 0, 0);
        continue;
      }
    }
    const int j = base + (u * kThreads + threadIdx.x) * 4;
    if (j + 3 < nbv) {
      v[u] = __ldcg(k4 + j / 4);
    } else {
      v[u] = make_uint4(0, 0, 0, 0);
      if (j < nbv) v[u].x = __ldcg(keys + j);
      if (j + 1 < nbv) v[u].y = __ldcg(keys + j + 1);
      if (j + 2 < nbv) v[u].z = __ldcg(keys + j + 2);
    }
  }
}

// f(j, key) for the tile's usable blocks (key != 0).
template <int kThreads, bool kBounded, int kN, typename F>
__device__ __forceinline__ void visit_tile(const uint4 (&v)[kN], int base, int nbv, F&& f) {
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    if constexpr (kBounded) {
      if (base + u * kThreads * 4 >= nbv) break;  // uniform over the CTA
    }
    const int j = base + (u * kThreads + threadIdx.x) * 4;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t key = word(v[u], e);
      if (key != 0) f(j + e, key);
    }
  }
}

// f(j, key) for every usable block of a row: from the registers of a resident tile (rows of
// at most kTile blocks, loaded once with load_tile<true>), else streamed through L2 tile by
// tile.
template <int kThreads, int kN, typename F>
__device__ __forceinline__ void for_each_key(const uint32_t* keys, int nbv, bool resident,
                                             const uint4 (&tile)[kN], F&& f) {
  if (resident) {
    visit_tile<kThreads, true>(tile, 0, nbv, f);
    return;
  }
  for (int base = 0; base < nbv; base += kThreads * 4 * kN) {
    uint4 v[kN];
    load_tile<kThreads, false>(keys, nbv, base, v);
    visit_tile<kThreads, false>(v, base, nbv, f);
  }
}

// Generic path: exact radix select (3 passes of 11/11/10 bits), winners gathered in block
// order, bitonic sort (score desc, block asc). Returns kb; sh.u.g.winners[0, kb) sorted.
// NOTES: out of line: its code is not between the fast path's pieces, which a short row's last
// CTA fetches cold (paired with another kernel: P8192 -0.2 us).
template <int kThreads>
__device__ __noinline__ int select_generic(const uint32_t* K, int nbv, SelectShared& sh) {
  constexpr int kWarps = Shape<kThreads>::kWarps;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint32_t* hist = sh.u.g.hist;
  unsigned long long* winners = sh.u.g.winners;
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
      for (int i = tid; i < kRadixBins; i += kThreads) hist[i] = 0;
      __syncthreads();
      for (int base = 0; base < nbv; base += kRadixUnroll * kThreads) {
        uint32_t d[kRadixUnroll];
#pragma unroll
        for (int u = 0; u < kRadixUnroll; ++u) {
          const int j = base + u * kThreads + tid;
          d[u] = 0xffffffffu;  // sentinel: no bin
          if (j < nbv) {
            const uint32_t key = __ldcg(K + j);
            if ((key & mask) == prefix) d[u] = (key >> shift) & (nbins - 1);
          }
        }
        // NOTES: when the whole warp holds one digit (mass ties), one lane adds for all.
#pragma unroll
        for (int u = 0; u < kRadixUnroll; ++u) {
          const uint32_t d0 = __shfl_sync(0xffffffffu, d[u], 0);
          if (__all_sync(0xffffffffu, d[u] == d0)) {
            if (lane == 0 && d0 != 0xffffffffu) atomicAdd(&hist[d0], 32u);
          } else if (d[u] != 0xffffffffu) {
            atomicAdd(&hist[d[u]], 1u);
          }
        }
      }
      __syncthreads();
      constexpr int kPer = kRadixBins / kThreads;
      int cnt[kPer];
      int sum = 0;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int bj = int(nbins) - 1 - kPer * tid - j;
        cnt[j] = bj >= 0 ? int(hist[bj]) : 0;
        sum += cnt[j];
      }
      const int incl = block_inclusive_scan(sum, sh.scan);
      int run = incl - sum;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (run < k_rem && k_rem <= run + cnt[j]) {
          sh.digit = int(nbins) - 1 - kPer * tid - j;
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

  // Gather winners in block order: warp w owns a contiguous segment.
  const int seg = ((nbv + kWarps * 32 - 1) / (kWarps * 32)) * 32;
  const int seg_lo = warp * seg;
  const int seg_hi = min(seg_lo + seg, nbv);
  int gt = 0, eq = 0;
  for (int j0 = seg_lo; j0 < seg_hi; j0 += 32) {
    const int j = j0 + lane;
    const uint32_t key = j < seg_hi ? __ldcg(K + j) : 0u;
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
    const int e = lane < kWarps ? sh.warp_eq[lane] : 0;
    int e_incl = e;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, e_incl, o);
      if (lane >= o) e_incl += y;
    }
    const int e_base = e_incl - e;
    const int take_eq = max(0, min(k_rem - e_base, e));
    const int c = (lane < kWarps ? sh.warp_gt[lane] : 0) + take_eq;
    int c_incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, c_incl, o);
      if (lane >= o) c_incl += y;
    }
    if (lane < kWarps) {
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
    for (int j0 = seg_lo; j0 < seg_hi; j0 += 32) {
      const int j = j0 + lane;
      const uint32_t key = j < seg_hi ? __ldcg(K + j) : 0u;
      const uint32_t mk = key & mask;
      const bool is_gt = key != 0 && mk > prefix;
      const bool is_eq = key != 0 && mk == prefix;
      const unsigned eq_bits = __ballot_sync(0xffffffffu, is_eq);
      const bool chosen = is_gt || (is_eq && eq_seen + __popc(eq_bits & lt) < k_rem);
      const unsigned ch_bits = __ballot_sync(0xffffffffu, chosen);
      if (chosen) {
        // Descending order of (key, ~j) = score descending, lower block first on ties.
        winners[pos + __popc(ch_bits & lt)] =
            (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(j));
      }
      eq_seen += __popc(eq_bits);
      pos += __popc(ch_bits);
    }
  }
  for (int i = kb + tid; i < kBlockTopk; i += kThreads) winners[i] = 0ull;
  __syncthreads();

  // Bitonic sort of the 512 winners, descending. NOTES: 256 threads own one pair per stage;
  // for strides <= 32 a warp's pairs stay inside its own 64 elements (__syncwarp only).
  if (kb > 1) {
    bool cross_warp_before = true;
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
          const unsigned long long a = winners[i], b = winners[k];
          const bool descending = (i & size) == 0;
          if ((a < b) == descending) {
            winners[i] = b;
            winners[k] = a;
          }
        }
      }
    }
  }
  __syncthreads();
  return kb;
}

// Block j's 4 tokens at place `place` of the row `out`. NOTES (v21): one 16-byte store where
// the row starts 16-byte aligned (two 8-byte stores where it starts 8-byte aligned), else 4
// scalar stores.
__device__ __forceinline__ void write_block(int32_t* out, int place, int64_t j) {
  static_assert(kRatio == 4, "a block's tokens are one int4");
  const uint32_t out_align = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(out) >> 2) & 3u;
  const int32_t t0 = static_cast<int32_t>(j * kRatio);
  int32_t* o = out + place * kRatio;
  if (out_align == 0) {
    *reinterpret_cast<int4*>(o) = make_int4(t0, t0 + 1, t0 + 2, t0 + 3);
  } else if (out_align == 2) {
    reinterpret_cast<int2*>(o)[0] = make_int2(t0, t0 + 1);
    reinterpret_cast<int2*>(o)[1] = make_int2(t0 + 2, t0 + 3);
  } else {
#pragma unroll
    for (int i = 0; i < kRatio; ++i) o[i] = t0 + i;
  }
}

// The columns after kb chosen blocks: the tail tokens 4 nb .. n - 1, then -1 (by the CTA).
template <int kThreads>
__device__ __forceinline__ void write_tail(int32_t* out, int kb, int64_t n, int64_t nb) {
  const int expanded = kb * kRatio;
  const int tail = static_cast<int>(n - nb * kRatio);
  const int64_t tail_first = nb * kRatio;
  for (int c = expanded + threadIdx.x; c < kWidth; c += kThreads) {
    out[c] = c < expanded + tail ? static_cast<int32_t>(tail_first + (c - expanded)) : -1;
  }
}

// Whether a row takes the pairs select (v27): uniform over the row's CTAs.
template <int kThreads>
__device__ __forceinline__ bool pairs_row(bool pairs, bool b_ok, int64_t nbv) {
  const int64_t kc = (nbv + gridDim.x - 1) / gridDim.x;
  return pairs && b_ok && nbv > 0 && nbv <= Shape<kThreads>::kPairsMaxBlocks &&
         kc * nbv <= kPairsWork;
}

// 1 if block j (key kj) comes before block i (key ki) in the row: key desc, block asc.
__device__ __forceinline__ int comes_before(uint32_t kj, int j, uint32_t ki, int i) {
  return kj > ki || (kj == ki && j < i) ? 1 : 0;
}

// The pairs select of one row (v27, see kPairsMaxRows): K its nv keys, ctr its epoch counter.
// NOTES: each thread holds its blocks' keys in registers (tile slots) and counts, for every
// block i of the CTA's share, how many of them come before i; a warp sums two blocks' counts
// at once (16-bit halves of one word) and adds them in shared memory. A thread's key kj
// comes before i when kj > ki, or kj == ki and j < i: for j below the share that is
// kj >= ki, for j above it kj - 1 >= ki, so each compare is one subtraction's sign
// (keys <= +inf's key + 1 < 2^31); the share's own blocks are ranked among themselves apart.
template <int kThreads>
__device__ __forceinline__ void select_pairs(const uint32_t* K, int nv, int64_t n, int64_t nb,
                                             int32_t* out, int32_t* ctr, SelectShared& sh) {
  constexpr int kWarps = Shape<kThreads>::kWarps;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ctas = static_cast<int>(gridDim.x);
  const int kc = (nv + ctas - 1) / ctas;  // <= 256: kc * nv <= kPairsWork, kc <= nv
  const int i0 = min(static_cast<int>(blockIdx.x) * kc, nv), i1 = min(i0 + kc, nv);
  int* share = reinterpret_cast<int*>(sh.u.f.cursor);      // ki - 1 of the share's blocks
  uint32_t* counts = sh.u.f.start;                         // two blocks per word
  __syncthreads();  // every warp's keys stored before the release
  if (tid == 0) {
    const int add = detail::epoch_add(blockIdx.x == 0, ctas, kPairsEpoch);
    detail::epoch_wait(ctr, static_cast<uint32_t>(atomic_add_acq_rel_gpu(ctr, add)), kPairsEpoch);
  }
  __syncthreads();
  detail::allow_dependents();  // the row's keys are stored: the next kernel may take the SMs left
  uint4 v[kPairsSlots];
  load_tile<kThreads, true>(K, nv, 0, v);
  const uint32_t own = tid < i1 - i0 ? __ldcg(K + i0 + tid) : 0u;
  if (tid < kc + 1) share[tid] = static_cast<int>(own) - 1;  // padded: kc may be odd
  if (tid < (kc + 1) / 2) counts[tid] = 0u;
  uint32_t usable = 0;
  int kp[kPairsSlots][4];
#pragma unroll
  for (int u = 0; u < kPairsSlots; ++u) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = (u * kThreads + tid) * 4 + e;
      const uint32_t kj = word(v[u], e);
      usable += kj != 0 ? 1u : 0u;
      kp[u][e] = j < i0 ? static_cast<int>(kj) : j >= i1 ? static_cast<int>(kj) - 1 : -1;
    }
  }
  usable = __reduce_add_sync(0xffffffffu, usable);
  if (lane == 0) sh.warp_gt[warp] = static_cast<int>(usable);
  __syncthreads();
  if (blockIdx.x == gridDim.x - 1) {  // off the rank's path: it needs only the usable count
    int u = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) u += sh.warp_gt[w];
    write_tail<kThreads>(out, min(kBlockTopk, u), n, nb);
  }
  // The share's own blocks among themselves (thread m: block i0 + m).
  int rank = 0;
  if (tid < i1 - i0) {
    for (int m = 0; m < i1 - i0; ++m) {
      rank += comes_before(static_cast<uint32_t>(share[m] + 1), m, own, tid);
    }
  }
  // Warps whose second slot holds blocks of the row (uniform over the warp).
  const bool slot1 = (kThreads + warp * 32) * 4 < nv;
  static_assert(kPairsSlots == 2, "the rank loop below takes one or two slots");
  for (int m = 0; m < i1 - i0; m += 2) {
    const int2 q = *reinterpret_cast<const int2*>(share + m);  // ki - 1 of blocks m, m + 1
    uint32_t a = 0, b = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      a += static_cast<uint32_t>(q.x - kp[0][e]) >> 31;
      b += static_cast<uint32_t>(q.y - kp[0][e]) >> 31;
    }
    if (slot1) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        a += static_cast<uint32_t>(q.x - kp[1][e]) >> 31;
        b += static_cast<uint32_t>(q.y - kp[1][e]) >> 31;
      }
    }
    const uint32_t ab = __reduce_add_sync(0xffffffffu, a | (b << 16));  // each <= 256
    if (lane == 0) atomicAdd(counts + m / 2, ab);
  }
  __syncthreads();
  if (tid < i1 - i0 && own != 0) {
    rank += static_cast<int>((counts[tid / 2] >> (16 * (tid & 1))) & 0xffffu);
    if (rank < kBlockTopk) write_block(out, rank, i0 + tid);
  }
}

// kStreamed: a launch whose table can hold more than kTile blocks (streamed_launch). A launch
// without streamed rows runs an instantiation without their code (streamed visits, the
// distributed select, the row's largest key in global memory), so a short row's last CTA
// fetches less code.
// T: the element type of q and the keys (__half, __nv_bfloat16, __nv_fp8_e4m3).
// kPageChunks: page_chunks(C): the loop's chunks are 16 slots of one padded page (cdiv: the
// padded page's Cp slots; v38), else of the row's blocks (cdiv: C).
template <typename T, bool kStreamed, bool kPageChunks, int kThreads>
__device__ __forceinline__ void select_row(const SelectParams& p, const KeyDiv& cdiv,
                                           int64_t row0, int64_t ncap,
                                           uint32_t* __restrict__ keys,
                                           int32_t* __restrict__ counters,
                                           uint32_t* __restrict__ dist, bool pairs) {
  using S = Shape<kThreads>;
  constexpr int kWarps = S::kWarps, kGroups = S::kGroups;
  constexpr int kBinsPerThread = S::kBinsPerThread, kBinWords = S::kBinWords;
  constexpr int kLoads = key_loads<T>();
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  __shared__ SelectShared sh;
  detail::grid_dependency_wait();  // before the first global access (a launch with pdl)
  const int64_t rl = blockIdx.y;
  const int64_t r = row0 + rl;
  const int tid = threadIdx.x, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates
  const int grp = tid / kGroupThreads, gtid = tid % kGroupThreads, gwarp = gtid >> 5;
  // Group grp of CTA x owns the pages (grp * X + x) + k * 2X: a distributed row's CTA reads
  // back its own keys by these pages. Who scores which blocks (wfirst, then + stride):
  // NOTES (v7w): a launch without streamed rows whose grid has more page groups than the
  // table has pages (a short row spread over more SMs than pages) deals warp chunks of
  // kWarpChunk blocks across the CTAs (warp (grp, gwarp) of CTA x takes chunk (gwarp * 2 +
  // grp) X + x), so that every SM reads a few KiB instead of a page, and every group scores.
  // Otherwise warp gwarp of a group takes its page's kWarpChunk blocks from kWarpChunk gwarp.
  // Either way a warp's chunk lies in one page.
  const int64_t first = (int64_t(grp) * gridDim.x + blockIdx.x) * kScoreChunk;
  constexpr bool streamed = kStreamed;  // == streamed_launch(ncap)
  const bool spread = !streamed && int64_t(gridDim.x) * kGroups * kScoreChunk > ncap;
  const int64_t wfirst =
      spread ? (int64_t(gwarp) * kGroups + grp) * gridDim.x * kWarpChunk +
                   int64_t(blockIdx.x) * kWarpChunk
             : first + kWarpChunk * gwarp;

  // NOTES: the dependent chain before the keys is 3 loads: token_to_req, the query position
  // and q go out together; the sequence length and the first page-table entry then go out
  // together (asm volatile loads: the compiler otherwise sinks them below the branches).
  // The first loads are coherent (detail::kFirst): nothing may move above the wait.
  const int64_t b = detail::ldg32_pred<detail::kFirst>(p.token_to_req + r, true, -1);
  const int64_t pos1 = detail::ldg64<detail::kFirst>(p.query_positions + r) + 1;
  // B fragments: lane (g, t) holds head g's dims 8 (4 s + t) .. + 8 for s < 4 (zero for the
  // padding heads g >= 4). The mma's k order is a permutation of the dims, the same for q
  // and the keys, so the dot products are unchanged.
  const T* q = static_cast<const T*>(p.q) + r * (kIndexHeads * kIndexDim);
  uint4 qv[4];
  {  // q's B fragments (qraw: its raw loads)
    const bool qvec = detail::aligned16(p.q);
    uint4 qraw[kLoads];
#pragma unroll
    for (int s = 0; s < kLoads; ++s) {
      const T* qs = q + (g < kIndexHeads ? g : 0) * kIndexDim + dim_offset<T>(s, t);
      if constexpr (Elem<T>::kBytes == 2) {
        qraw[s] = detail::load8_first_any(qs, qvec, g < kIndexHeads);
      } else {
        qraw[s] = load16_first_any(qs, qvec, g < kIndexHeads);
      }
    }
    widen<T>(qraw, qv);
  }
  const bool b_ok = b >= 0 && b < p.requests;
  const int32_t* table = p.page_table + (b_ok ? b : 0) * p.page_table_stride;
  const int64_t len = detail::ldg32_pred(p.sequence_lengths + (b_ok ? b : 0), b_ok, 0);
  const int64_t stride = int64_t(gridDim.x) * kGroups * kScoreChunk;
  // The pages of the warp's first 2 kDepth chunks (the table's entries: the row's length is not
  // known yet; j < ncap: the table has the chunk's page, and with M = 0 there is none to read).
  // kPageChunks: one entry per chunk (a == b); else the pages of this lane's blocks j + g
  // (a) and j + g + 8 (b).
  // NOTES (v34): the scoring loop's block indices are 32-bit (Ix): the op refuses
  // M * C > INT32_MAX, so a row's blocks are < 2^31 and every index the loop forms (at most
  // 3 kDepth strides of at most 2^18 past them) is < 2^32; the int64 ones of v33 were about
  // half of the loop's instructions (64-bit compares, products, the page division).
  // NOTES (v38): kPageChunks: the loop's indices are slots of padded pages (slot v = page
  // v / Cp, row v % Cp of it, the row's block (v / Cp) C + v % Cp where v % Cp < C); M Cp
  // < 2^32 (Cp < C + 16 <= 9 C / 8).
  using Ix = uint32_t;
  const Ix C32 = kPageChunks ? static_cast<Ix>(p.keys_per_page) : cdiv.d;  // a page's blocks
  const Ix ncap32 = static_cast<Ix>(kPageChunks ? p.table_width * cdiv.d : ncap);
  const Ix stride32 = static_cast<Ix>(stride);
  auto lookup = [&](Ix j, Ix lim, bool pred) {
    return detail::ldg32_pred(table + (j < lim ? cdiv.div32(j) : 0u), pred && j < lim, -1);
  };
  auto page_first = [&](Ix j) {
    if constexpr (kPageChunks) {
      const int32_t v = lookup(j, ncap32, b_ok);
      return int2{v, v};
    } else {
      return int2{lookup(j + g, ncap32, b_ok), lookup(j + g + 8, ncap32, b_ok)};
    }
  };
  // NOTES (v31, v32): chunks in flight per warp. float8 keys: a chunk's loads are half the
  // bytes of a 2-byte chunk's; four chunks (v31) were 3-5 % slower than three (v32: ncu, H100,
  // R = 8 / 64 / 256); one less where each lane looks up its own pages (!kPageChunks), whose
  // four-chunk build spilled 8-16 bytes (the GPU suite's spill check, H200 run of v31).
  // v49: one less in a 256-thread CTA (<= 128 registers; four spilled 28 bytes).
  constexpr int kDepth = Elem<T>::kBytes == 1
                             ? (kPageChunks && kThreads == 512 ? QSA_SELECT_FP8_DEPTH
                                                               : QSA_SELECT_FP8_DEPTH - 1)
                             : 2;
  int2 ph[2 * kDepth];
#pragma unroll
  for (int k = 0; k < 2 * kDepth; ++k) {
    ph[k] = page_first(static_cast<Ix>(wfirst) + k * stride32);
  }
  int64_t n = pos1 < len ? pos1 : len;
  n = n > 0 ? n : 0;
  const int64_t nb = n / kRatio;
  const int64_t nbv = b_ok ? (nb < ncap ? nb : ncap) : 0;  // candidate blocks
  const Ix nbv32 = static_cast<Ix>(nbv);
  // The loop's end: the slot after the row's last block (kPageChunks), else nbv.
  Ix nend32 = nbv32;
  if constexpr (kPageChunks) {
    const Ix last_page = nbv32 > 0 ? (nbv32 - 1) / C32 : 0u;  // once per thread
    nend32 = nbv32 > 0 ? last_page * cdiv.d + (nbv32 - last_page * C32) : 0u;
  }
  uint32_t* row_keys = keys + rl * key_stride(ncap);

  // ---- Scores: each warp scores 16 blocks of one page per iteration -----------------------
  const T* ck = static_cast<const T*>(p.compressed_keys);
  const uint32_t zero = static_cast<uint32_t>(ncap >> 62);  // ncap < 2^62
  auto usable_page = [&](int64_t ph) { return ph >= 0 && ph < p.pages; };
  // kPageChunks: slot j0's chunk (j0 < nend: the chunk has a block of the row): the row's
  // block of its first slot (first) and the page row of its first slot (base); rows past
  // last (the page's or the row's last block) are not the row's.
  struct ChunkRows {
    Ix first, base, last;
  };
  auto chunk_rows = [&](Ix j0) {
    const Ix page = cdiv.div32(j0);
    const Ix base = j0 - page * cdiv.d, first = page * C32 + base;
    return ChunkRows{first, base, base + min(C32 - 1u - base, nbv32 - 1u - first)};
  };
  // The warp scores blocks j0 + (0..15) (kPageChunks: slots); lane (g, t) loads rows g and
  // g + 8 (A fragments), dims dim_offset(s, t) .. + 8 (fp8: + 16). NOTES: kPageChunks:
  // unpredicated loads of a clamped row (same page); a clamped row's score is not stored. An
  // unusable page is never read (else: each block's load predicated on its own page).
  auto issue = [&](Ix j0, int2 ph, uint4(&ra)[kLoads], uint4(&rb)[kLoads]) {
    if constexpr (kPageChunks) {  // j0 < nend: nbv >= 1
      const ChunkRows cr = chunk_rows(j0);
      const T* pg = ck + int64_t(ph.x) * p.ck_page_stride;
      const T* pa = pg + int64_t(min(cr.base + g, cr.last)) * p.ck_row_stride + dim_offset<T>(0, t);
      const T* pb =
          pg + int64_t(min(cr.base + g + 8, cr.last)) * p.ck_row_stride + dim_offset<T>(0, t);
#pragma unroll
      for (int s = 0; s < kLoads; ++s) {
        const int o = dim_offset<T>(s, t) - dim_offset<T>(0, t);
        ra[s] = __ldg(reinterpret_cast<const uint4*>(pa + o));
        rb[s] = __ldg(reinterpret_cast<const uint4*>(pb + o));
      }
    } else {
      const Ix ja = j0 + g, jb = j0 + g + 8;
      const bool oka = usable_page(ph.x), okb = usable_page(ph.y);
      const T* pa = ck + int64_t(oka ? ph.x : 0) * p.ck_page_stride +
                    int64_t(oka ? ja - cdiv.div32(ja) * C32 : 0u) * p.ck_row_stride +
                    dim_offset<T>(0, t);
      const T* pb = ck + int64_t(okb ? ph.y : 0) * p.ck_page_stride +
                    int64_t(okb ? jb - cdiv.div32(jb) * C32 : 0u) * p.ck_row_stride +
                    dim_offset<T>(0, t);
#pragma unroll
      for (int s = 0; s < kLoads; ++s) {
        const int o = dim_offset<T>(s, t) - dim_offset<T>(0, t);
        ra[s] = detail::ldg16_pred(pa + o, oka);
        rb[s] = detail::ldg16_pred(pb + o, okb);
      }
    }
  };
  // Whether the chunk has anything to read (kPageChunks: its page; else any lane's blocks).
  auto usable_chunk = [&](int2 ph) {
    if constexpr (kPageChunks) {
      return usable_page(ph.x);
    } else {
      return __any_sync(0xffffffffu, usable_page(ph.x) || usable_page(ph.y));
    }
  };
  // NOTES (v7j, v7t, v31): with 16-byte loads, kDepth chunks are in flight per warp: the key
  // loads of the chunk kDepth - 1 ahead go out before this chunk's mma. The loop is unrolled
  // by kDepth with the buffers' roles rotated, because a loop-carried copy of the next chunk's
  // registers made the copy wait for its loads before the chunk after it could be issued
  // (ncu, R = 256: half of the warp samples there), i.e. one chunk in flight during every
  // wait. The page-table entries are loaded 2 kDepth chunks ahead.
  constexpr bool kPipe = true;  // keys are 16-byte aligned (contract v2)
  uint4 bufa[kDepth][kLoads], bufb[kDepth][kLoads];
  uint32_t kmax = 0;  // the largest key this thread stored
  // The scores of a chunk's blocks g and g + 8 (summed over the heads after ReLU; lanes t = 0
  // and 1 hold them) from its loaded rows.
  auto chunk_scores = [&](uint4(&ca)[kLoads], uint4(&cb)[kLoads], float& lo, float& hi) {
    // NOTES: the first mma is made to depend on every load of this chunk (`zero` is 0 at
    // run time, unknown to the compiler), so that ptxas issues all 8 loads before it.
    uint32_t later = cb[0].x;
#pragma unroll
    for (int s = 1; s < kLoads; ++s) later |= ca[s].x | cb[s].x;
    ca[0].x |= later & zero;
    uint4 ha[4], hb[4];
    widen<T>(ca, ha);
    widen<T>(cb, hb);
    // NOTES (v33): QSA_SELECT_CHAINS independent accumulators (k-step u of each
    // s), summed after: one chain made the 8 mma of a chunk wait on each other (SASS of v31).
    constexpr int kChains = QSA_SELECT_CHAINS;
    float part[kChains][4];
    detail::zero_chains(part);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        mma_16816<kBf16>(part[(2 * s + u) % kChains], word(ha[s], 2 * u), word(hb[s], 2 * u),
                         word(ha[s], 2 * u + 1), word(hb[s], 2 * u + 1), word(qv[s], 2 * u),
                         word(qv[s], 2 * u + 1));
      }
    }
    float acc[4];
    detail::sum_chains(part, acc);
    // acc: (block g, heads 2t, 2t+1), (block g + 8, heads 2t, 2t+1); heads >= 4 are zero.
    // ReLU also maps -0.0 to +0.0.
    lo = (acc[0] > 0.f ? acc[0] : 0.f) + (acc[1] > 0.f ? acc[1] : 0.f);
    hi = (acc[2] > 0.f ? acc[2] : 0.f) + (acc[3] > 0.f ? acc[3] : 0.f);
    lo += __shfl_xor_sync(0xffffffffu, lo, 1);
    hi += __shfl_xor_sync(0xffffffffu, hi, 1);
  };
  // Chunk j0 on page ph from (ca, cb); chunk j0 + (kDepth - 1) * stride (page ph_next) issued
  // into (na, nb4).
  auto score_step = [&](Ix j0, int2 ph, int2 ph_next, uint4(&ca)[kLoads],
                        uint4(&cb)[kLoads], uint4(&na)[kLoads], uint4(&nb4)[kLoads]) {
    const Ix j1 = j0 + (kDepth - 1) * stride32;
    if (kPipe && j1 < nend32 && usable_chunk(ph_next)) issue(j1, ph_next, na, nb4);
    // The row's blocks of rows g and g + 8 (kPageChunks: of the chunk's slots), and whether
    // they are the row's.
    Ix ja = j0 + g, jb = j0 + g + 8;
    bool ina = ja < nbv32, inb = jb < nbv32;
    if constexpr (kPageChunks) {
      const ChunkRows cr = chunk_rows(j0);
      ja = cr.first + g, jb = cr.first + g + 8;
      ina = cr.base + g <= cr.last, inb = cr.base + g + 8 <= cr.last;
      if (!usable_chunk(ph)) {
        // Never read: an unusable block gets key 0 and can never be chosen.
        if (lane < kWarpChunk && cr.base + lane <= cr.last) row_keys[cr.first + lane] = 0u;
        return;
      }
    } else if (!usable_chunk(ph)) {
      if (lane < kWarpChunk && j0 + lane < nbv32) row_keys[j0 + lane] = 0u;
      return;
    }
    if (!kPipe) issue(j0, ph, ca, cb);
    float lo, hi;
    chunk_scores(ca, cb, lo, hi);
    if (t == 0) {
      // kPageChunks: the chunk's page is usable (above); else each block's own page.
      const bool oka = kPageChunks || usable_page(ph.x), okb = kPageChunks || usable_page(ph.y);
      const uint32_t klo = oka ? __float_as_uint(lo * kScoreScale) + 1u : 0u;
      const uint32_t khi = okb ? __float_as_uint(hi * kScoreScale) + 1u : 0u;
      if (ina) {
        row_keys[ja] = klo;
        kmax = max(kmax, klo);
      }
      if (inb) {
        row_keys[jb] = khi;
        kmax = max(kmax, khi);
      }
    }
  };
  auto page_ahead = [&](Ix j) {  // loaded inside the loop: only pages of the row
    if constexpr (kPageChunks) {
      const int32_t v = lookup(j, nend32, true);
      return int2{v, v};
    } else {
      return int2{lookup(j + g, nbv32, true), lookup(j + g + 8, nbv32, true)};
    }
  };
  // Chunk k of a round of kDepth (j0 + k * stride) is scored from buffer k while chunk
  // k + kDepth - 1 goes out into buffer (k + kDepth - 1) % kDepth; pages are loaded
  // 2 kDepth chunks ahead (ph[i]: chunk j0 + i * stride).
  // (QSA_SELECT_FLAT=2: not where rows may be streamed, whose float8 build spills at 128)
  constexpr bool kFlat = QSA_SELECT_FLAT == 1 || (QSA_SELECT_FLAT == 2 && !kStreamed);
  if constexpr (kPageChunks) {
    // NOTES (v40, v42): the lean loop (pages of whole chunks), the same pipeline as the loop
    // below with lighter index work: at 80 registers (v40's scores-only kernel, since
    // deleted) that loop recomputed 64-bit page, row and key addresses, the chunk's division
    // twice and the row's key pointer per store (SASS: ~130 of its 216 instructions per chunk
    // were integer). Here a chunk is (page, page row) from one 32 x 32 -> 64 multiply, its
    // rows' addresses products of 32-bit page and row ids off a byte pointer, page ids checked
    // in 32 bits. The row's key and page-table pointers are opaque to the compiler, so they
    // stay in registers instead of being rebuilt from (keys, rl, ncap) at every store (SASS:
    // 10 instructions a store).
    uint32_t* rk = row_keys;
    asm volatile("" : "+l"(rk));
    const int32_t* tb = table;  // the same for the row's page-table entries
    asm volatile("" : "+l"(tb));
    auto page_lean = [&](Ix j) {  // loaded inside the loop: only pages of the row
      return detail::ldg32_pred(tb + (j < nend32 ? cdiv.div32(j) : 0u), j < nend32, -1);
    };
    const char* ckb = reinterpret_cast<const char*>(ck + dim_offset<T>(0, t));
    const uint64_t psb = static_cast<uint64_t>(p.ck_page_stride) * Elem<T>::kBytes;
    const uint64_t rsb = static_cast<uint64_t>(p.ck_row_stride) * Elem<T>::kBytes;
    // A page id is usable when 0 <= id < pages (a negative id is >= 2^31 as unsigned).
    const uint32_t pages32 = p.pages > 0x7fffffff ? 0x80000000u : static_cast<uint32_t>(p.pages);
    auto usable32 = [&](int32_t id) { return static_cast<uint32_t>(id) < pages32; };
    struct Chunk {
      Ix first, base, rows;  // the row's block of its first slot, that slot's page row, and
                             // how many of its 16 slots are the row's blocks (>= 1: j0 < nend)
    };
    auto chunk_of = [&](Ix j0) {
      const Ix page = cdiv.div32(j0);
      const Ix base = j0 - page * cdiv.d, first = page * C32 + base;
      return Chunk{first, base, min(C32 - base, nbv32 - first)};
    };
    // kFlat (v44): the loads predicated on `go`, the registers keeping their values when off;
    // else unpredicated (the caller tests `go`).
    auto issue_lean = [&](Ix j0, int32_t id, bool go, uint4(&ra)[kLoads], uint4(&rb)[kLoads]) {
      const Chunk ch = chunk_of(j0);
      const char* pg = ckb + uint64_t(static_cast<uint32_t>(id)) * psb;
      const char* pa = pg + uint64_t(ch.base + min(Ix(g), ch.rows - 1u)) * rsb;
      const char* pb = pg + uint64_t(ch.base + min(Ix(g + 8), ch.rows - 1u)) * rsb;
#pragma unroll
      for (int s = 0; s < kLoads; ++s) {
        const int o = (dim_offset<T>(s, t) - dim_offset<T>(0, t)) * Elem<T>::kBytes;
        if constexpr (kFlat) {
          detail::ldg16_keep(pa + o, go, ra[s]);
          detail::ldg16_keep(pb + o, go, rb[s]);
        } else {
          ra[s] = __ldg(reinterpret_cast<const uint4*>(pa + o));
          rb[s] = __ldg(reinterpret_cast<const uint4*>(pb + o));
        }
      }
    };
    auto score_lean = [&](Ix j0, int32_t id, int32_t id_next, uint4(&ca)[kLoads],
                          uint4(&cb)[kLoads], uint4(&na)[kLoads], uint4(&nb4)[kLoads]) {
      const Ix j1 = j0 + (kDepth - 1) * stride32;
      if (j1 < nend32 && usable32(id_next)) issue_lean(j1, id_next, true, na, nb4);
      const Chunk ch = chunk_of(j0);
      if (!usable32(id)) {  // never read: key 0, never chosen
        if (lane < ch.rows && lane < kWarpChunk) st_global32(rk + ch.first + lane, 0u);
        return;
      }
      float lo, hi;
      chunk_scores(ca, cb, lo, hi);
      if (t == 0) {
        const uint32_t klo = __float_as_uint(lo * kScoreScale) + 1u;
        const uint32_t khi = __float_as_uint(hi * kScoreScale) + 1u;
        if (Ix(g) < ch.rows) {
          st_global32(rk + ch.first + g, klo);
          kmax = max(kmax, klo);
        }
        if (Ix(g + 8) < ch.rows) {
          st_global32(rk + ch.first + g + 8, khi);
          kmax = max(kmax, khi);
        }
      }
    };
    // v44 (QSA_SELECT_FLAT): a chunk's step without branches (predicated loads that keep
    // their registers, predicated stores, an unusable chunk's keys 0 from the same stores),
    // and full rounds of kDepth chunks without the per-chunk exit, so that ptxas can overlap
    // one chunk's conversions and mma with the previous chunk's sums, shuffles and stores.
    auto score_flat = [&](Ix j0, int32_t id, int32_t id_next, uint4(&ca)[kLoads],
                          uint4(&cb)[kLoads], uint4(&na)[kLoads], uint4(&nb4)[kLoads]) {
      const Ix j1 = j0 + (kDepth - 1) * stride32;
      issue_lean(j1, id_next, j1 < nend32 && usable32(id_next), na, nb4);
      const Chunk ch = chunk_of(j0);
      float lo, hi;
      chunk_scores(ca, cb, lo, hi);
      // lanes t = 0 and 1 hold both sums: t = 0 stores row g, t = 1 row g + 8
      const float sc = t ? hi : lo;
      const Ix row = Ix(g) + (t ? 8u : 0u);
      const uint32_t key = usable32(id) ? __float_as_uint(sc * kScoreScale) + 1u : 0u;
      const bool st = t < 2 && j0 < nend32 && row < ch.rows;
      st_global32_pred(rk + ch.first + row, key, st);
      kmax = max(kmax, st ? key : 0u);
    };
    if constexpr (kFlat) {
#pragma unroll
      for (int k = 0; k < kDepth; ++k) {  // defined values for chunks that load nothing
#pragma unroll
        for (int s = 0; s < kLoads; ++s) bufa[k][s] = bufb[k][s] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int k = 0; k + 1 < kDepth; ++k) {
      const Ix j = static_cast<Ix>(wfirst) + k * stride32;
      if constexpr (kFlat) {
        issue_lean(j, ph[k].x, j < nend32 && usable32(ph[k].x), bufa[k], bufb[k]);
      } else {
        if (j < nend32 && usable32(ph[k].x)) issue_lean(j, ph[k].x, true, bufa[k], bufb[k]);
      }
    }
    for (Ix j0 = static_cast<Ix>(wfirst); j0 < nend32; j0 += kDepth * stride32) {
      int2 ahead[kDepth];
#pragma unroll
      for (int k = 0; k < kDepth; ++k) {
        const int32_t v = page_lean(j0 + (2 * kDepth + k) * stride32);
        ahead[k] = int2{v, v};
      }
      if (kFlat && j0 + (kDepth - 1) * stride32 < nend32) {  // a full round: one block
#pragma unroll
        for (int k = 0; k < kDepth; ++k) {
          score_flat(j0 + k * stride32, ph[k].x, ph[k + kDepth - 1].x, bufa[k], bufb[k],
                     bufa[(k + kDepth - 1) % kDepth], bufb[(k + kDepth - 1) % kDepth]);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kDepth; ++k) {
          if (k > 0 && j0 + k * stride32 >= nend32) break;
          if constexpr (kFlat) {
            score_flat(j0 + k * stride32, ph[k].x, ph[k + kDepth - 1].x, bufa[k], bufb[k],
                       bufa[(k + kDepth - 1) % kDepth], bufb[(k + kDepth - 1) % kDepth]);
          } else {
            score_lean(j0 + k * stride32, ph[k].x, ph[k + kDepth - 1].x, bufa[k], bufb[k],
                       bufa[(k + kDepth - 1) % kDepth], bufb[(k + kDepth - 1) % kDepth]);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kDepth; ++k) {
        ph[k] = ph[k + kDepth];
        ph[k + kDepth] = ahead[k];
      }
    }
  } else {
#pragma unroll
  for (int k = 0; k + 1 < kDepth; ++k) {
    const Ix j = static_cast<Ix>(wfirst) + k * stride32;
    if (kPipe && j < nend32 && usable_chunk(ph[k])) issue(j, ph[k], bufa[k], bufb[k]);
  }
  for (Ix j0 = static_cast<Ix>(wfirst); j0 < nend32; j0 += kDepth * stride32) {
    int2 ahead[kDepth];
#pragma unroll
    for (int k = 0; k < kDepth; ++k) ahead[k] = page_ahead(j0 + (2 * kDepth + k) * stride32);
#pragma unroll
    for (int k = 0; k < kDepth; ++k) {
      if (k > 0 && j0 + k * stride32 >= nend32) break;
      score_step(j0 + k * stride32, ph[k], ph[k + kDepth - 1], bufa[k], bufb[k],
                 bufa[(k + kDepth - 1) % kDepth], bufb[(k + kDepth - 1) % kDepth]);
    }
#pragma unroll
    for (int k = 0; k < kDepth; ++k) {
      ph[k] = ph[k + kDepth];
      ph[k + kDepth] = ahead[k];
    }
  }
  }  // the per-lane pages' loop

  if constexpr (!kStreamed) {
    if (pairs_row<kThreads>(pairs, b_ok, nbv)) {
      select_pairs<kThreads>(row_keys, static_cast<int>(nbv), n, nb, p.out + r * p.out_stride,
                   counters + kPairsSlot + rl * kPairsSpread, sh);
      return;
    }
  }

#if QSA_SELECT_SCORE_ONLY
  // Development build (timing the phases): the scores only, no arrival and no select (the
  // output is not written; the row counters are left as they are).
  return;
#endif
  // ---- Arrival: the row's last CTA selects ----------------------------------------------
  // A distributed row (v7p) counts three arrivals per CTA on its counter: scored, histogram
  // added, candidates pushed; the last of the third resets it.
  const bool dist_row = streamed && dist != nullptr && b_ok;  // uniform over the row's CTAs
  const int ctas = int(gridDim.x);
  uint32_t* gh = dist_row ? dist + rl * kDistWords : nullptr;   // the row's histogram
  uint32_t* gc = dist_row ? gh + kDigitBins : nullptr;          // its bins' next free slots
  unsigned long long* gb =                                      // its candidates
      dist_row ? reinterpret_cast<unsigned long long*>(gc + kDigitBins) : nullptr;
  if (dist_row && blockIdx.x == 0) {  // before this CTA's arrival: no CTA adds before it
    for (int i = tid; i < 2 * kDigitBins; i += kThreads) gh[i] = 0u;
  }
  // NOTES (v7r): only a launch whose rows can be streamed folds its largest key into the
  // row's slot; a resident row's last CTA takes it from the tile it holds (one L2 round trip,
  // the atomicExch after the arrival, fewer on the row's critical path).
  // NOTES (v19): every CTA zeroes the select's histogram before it arrives (the scoring does
  // not use that shared memory), so that the last one starts its select without it.
  for (int i = tid; i < kDigitBins; i += kThreads) sh.u.f.start[i] = 0;
  if (tid == 0) sh.work = 0;
  kmax = __reduce_max_sync(0xffffffffu, kmax);
  if (lane == 0) sh.scan[tid >> 5] = static_cast<int>(kmax);  // keys < 2^31
  __syncthreads();
  uint32_t* maxkey = reinterpret_cast<uint32_t*>(counters + kMaxKeySlot + rl);
  if (tid < 32) {
    const uint32_t m = __reduce_max_sync(
        0xffffffffu, lane < kWarps ? static_cast<uint32_t>(sh.scan[lane]) : 0u);
    if (tid == 0) {
      if (m && streamed) atomicMax(maxkey, m);  // ordered before the arrival's release
      // NOTES (v57): a row of one CTA (no streamed rows) selects without an arrival: the
      // keys it reads back are its own, stored before the barrier above.
      const bool solo = QSA_SELECT_SOLO && !streamed && ctas == 1;
      const int before = solo ? 0 : atomic_add_acq_rel_gpu(counters + rl, 1);
      if (dist_row) {
        while (detail::ld_acquire_gpu(counters + rl) < ctas) {
        }
        sh.maxkey = static_cast<uint32_t>(
            detail::ld_acquire_gpu(reinterpret_cast<const int32_t*>(maxkey)));
      } else {
        sh.is_last = before == ctas - 1;
        if (sh.is_last && streamed) sh.maxkey = atomicExch(maxkey, 0u);  // after the acquire
      }
    }
  }
  __syncthreads();
  detail::allow_dependents();  // scores stored: the next kernel may take the SMs left
  if (!dist_row && !sh.is_last) return;
  int32_t* out = p.out + r * p.out_stride;
  if (!b_ok) {
    for (int c = tid; c < kWidth; c += kThreads) out[c] = -1;
    if (tid == 0) counters[rl] = 0;  // ready for the next call (and graph replay)
    return;
  }
  const int nv = static_cast<int>(nbv);  // <= M * C <= INT32_MAX (checked by the op)
  const uint32_t* K = row_keys;
  uint32_t* start = sh.u.f.start;
  uint32_t* cursor = sh.u.f.cursor;
  // Histogram of the first digit over usable keys (start[] zeroed before the arrival). The
  // keys of rows of at most kTile blocks stay in registers for the second pass.
  constexpr int kSlots = kStreamed ? S::kStreamSlots : S::kSlots;
  const bool resident = !streamed || (!dist_row && nv <= kThreads * 4 * kSlots);
  uint4 tile[kSlots];
  if (resident) load_tile<kThreads, true>(K, nv, 0, tile);
  if (!streamed) {
    uint32_t m = 0;
#pragma unroll
    for (int u = 0; u < kSlots; ++u) m = max(max(tile[u].x, tile[u].y), max(tile[u].z, m));
#pragma unroll
    for (int u = 0; u < kSlots; ++u) m = max(tile[u].w, m);
    m = __reduce_max_sync(0xffffffffu, m);
    if (lane == 0) sh.scan[tid >> 5] = static_cast<int>(m);  // read before the next scan
  }
  __syncthreads();
  uint32_t top = sh.maxkey;
  if (!streamed) {
    top = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) top = max(top, static_cast<uint32_t>(sh.scan[w]));
  }
  top >>= kDigitShift;
  // This CTA's own blocks (a distributed row): its groups' pages, thread gtid < 128 one block.
  auto for_own_key = [&](auto&& f) {
    for (int64_t j0 = first; j0 < nbv; j0 += stride) {
      const int64_t j = j0 + gtid;
      if (gtid < kScoreChunk && j < nbv) {
        const uint32_t key = __ldcg(K + j);
        if (key != 0) f(static_cast<int>(j), key);
      }
    }
  };
  if (dist_row) {
    for_own_key([&](int, uint32_t key) { atomicAdd(&start[first_digit(key, top)], 1u); });
    __syncthreads();
    for (int i = tid; i < kDigitBins; i += kThreads) {
      if (start[i]) atomicAdd(gh + i, start[i]);
    }
    __syncthreads();
    if (tid == 0) {
      detail::red_add_release_gpu(counters + rl, 1);
      while (detail::ld_acquire_gpu(counters + rl) < 2 * ctas) {
      }
    }
    __syncthreads();
    for (int i = tid; i < kDigitBins; i += kThreads) start[i] = __ldcg(gh + i);
  } else {
    // NOTES: plain shared atomics (fire and forget): a warp vote per key to aggregate mass
    // ties cost ~40 cycles of dependent latency per key on the row's critical path.
    for_each_key<kThreads>(K, nv, resident, tile, [&](int, uint32_t key) {
      atomicAdd(&start[first_digit(key, top)], 1u);
    });
  }
  __syncthreads();
  // Thread t owns bins 4095 - 8 t - i (i < 8), scanned from the top.
  // NOTES (v7r): its 8 bins are two 16-byte loads; 8 scalar loads at a stride of 8 words
  // were 8-way bank conflicts (64 wavefronts per warp, ~1,000 cycles of the CTA's 16 warps).
  const int bin0 = kDigitBins - kBinsPerThread * (tid + 1);  // its lowest bin
  int cnt[kBinsPerThread];
  int sum = 0;
#pragma unroll
  for (int q = 0; q < kBinWords; ++q) {  // bins bin0 + 4 q + i = 4095 - 8 tid - (7 - 4 q - i)
    const uint4 w4 = *reinterpret_cast<const uint4*>(start + bin0 + 4 * q);
#pragma unroll
    for (int i = 0; i < 4; ++i) cnt[kBinsPerThread - 1 - 4 * q - i] = int(word(w4, i));
  }
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) sum += cnt[i];
  // NOTES (v19): one barrier after the scan, not three. Bins are scanned from the top, so a
  // bin's exclusive count `run` is the number of keys above it; the bin of the 512-th largest
  // key, d1, is the one with run < 512 <= run + count, and the bins at or above it are exactly
  // those with run < 512. So each bin's first slot and the rank work (the sum of count^2 over
  // the bins at or above d1) need no d1, and are written with the search for it.
  const int incl = block_inclusive_scan(sum, sh.scan);
  if (tid == kThreads - 1) sh.usable = incl;
  {
    int run = incl - sum;
    // NOTES (v20): the rank work in 32 bits: a bin of more than kBufCap keys fails the fast
    // path's other test anyway, so counts are clamped to kBufCap + 1 and a thread's sum to
    // kRankWorkCap + 1 (still above the cap where the true sum is): a warp's REDUX and one
    // shared atomic, not a 64-bit shuffle tree and a CAS loop.
    uint32_t w = 0;
    // The thread's bins, if its top one is at or above d1 (else none is ever read).
    if (run < kBlockTopk) {
      uint32_t st[kBinsPerThread], cu[kBinsPerThread];
#pragma unroll
      for (int i = 0; i < kBinsPerThread; ++i) {
        if (kBlockTopk <= run + cnt[i] && run < kBlockTopk) {
          sh.digit = kDigitBins - 1 - kBinsPerThread * tid - i;
          sh.above = run;
          sh.digit_count = cnt[i];
        }
        if (run < kBlockTopk) {
          const uint32_t c = static_cast<uint32_t>(min(cnt[i], kBufCap + 1));
          w += c * c;
        }
        st[i] = run;
        cu[i] = dist_row ? run + cnt[i] : run;  // a distributed row's buffer is filled
        run += cnt[i];
      }
      // st[i] is bin 4095 - 8 tid - i = bin0 + 7 - i
      constexpr int h = kBinsPerThread - 1;
#pragma unroll
      for (int q = 0; q < kBinWords; ++q) {
        *reinterpret_cast<uint4*>(start + bin0 + 4 * q) =
            make_uint4(st[h - 4 * q], st[h - 4 * q - 1], st[h - 4 * q - 2], st[h - 4 * q - 3]);
      }
#pragma unroll
      for (int q = 0; q < kBinWords; ++q) {
        *reinterpret_cast<uint4*>(cursor + bin0 + 4 * q) =
            make_uint4(cu[h - 4 * q], cu[h - 4 * q - 1], cu[h - 4 * q - 2], cu[h - 4 * q - 3]);
      }
    }
    w = __reduce_add_sync(0xffffffffu, min(w, uint32_t(kRankWorkCap) + 1u));
    if (lane == 0 && w) atomicAdd(&sh.work, w);
  }
  __syncthreads();
  const int usable = sh.usable;
  const int kb = min(kBlockTopk, usable);
  const bool all_win = usable <= kBlockTopk;
  const uint32_t d1 = all_win ? 0u : sh.digit;  // the bin of the 512-th largest key
  const int total = all_win ? usable : sh.above + sh.digit_count;  // keys with digit >= d1

  const bool fast = !p.generic_path && total <= kBufCap && sh.work <= uint32_t(kRankWorkCap);
  // (key, ~j) descending = score descending, lower block first on ties.
  auto entry = [](int j, uint32_t key) {
    return (static_cast<unsigned long long>(key) << 32) |
           (0xffffffffu - static_cast<uint32_t>(j));
  };
  if (dist_row) {
    // Every CTA computed the same bins from the same histogram: push, then the last ranks.
    if (fast) {
      for_own_key([&](int j, uint32_t key) {
        const uint32_t d = first_digit(key, top);
        if (d >= d1) gb[start[d] + atomicAdd(gc + d, 1u)] = entry(j, key);
      });
    }
    __syncthreads();
    if (tid == 0) sh.is_last = atomic_add_acq_rel_gpu(counters + rl, 1) == 3 * ctas - 1;
    __syncthreads();
    if (!sh.is_last) return;
    if (fast) {
      for (int i = tid; i < total; i += kThreads) sh.u.f.buf[i] = __ldcg(gb + i);
    }
  }
  if (fast) {
    // Fast path: every key at or above the threshold bin, grouped by bin.
    unsigned long long* buf = sh.u.f.buf;
    if (!dist_row) {
      for_each_key<kThreads>(K, nv, resident, tile, [&](int j, uint32_t key) {
        const uint32_t d = first_digit(key, top);
        if (d >= d1) buf[atomicAdd(&cursor[d], 1u)] = entry(j, key);
      });
    }
    __syncthreads();
    // A key's place = its bin's first slot + the bin mates above it; places < kb are output.
    for (int s = tid; s < total; s += kThreads) {
      const unsigned long long e = buf[s];
      const uint32_t bin = first_digit(static_cast<uint32_t>(e >> 32), top);
      const int lo = static_cast<int>(start[bin]), hi = static_cast<int>(cursor[bin]);
      int above_e = 0;
#pragma unroll 4
      for (int x = lo; x < hi; ++x) above_e += buf[x] > e ? 1 : 0;
      const int place = lo + above_e;
      if (place < kb) write_block(out, place, 0xffffffffu - static_cast<uint32_t>(e));
    }
  } else {
    // Generic path (more than kBufCap keys in or above the threshold bin: mass ties).
    const int kbg = select_generic<kThreads>(K, nv, sh);  // == kb
    const unsigned long long* winners = sh.u.g.winners;
    for (int c = tid; c < kbg * kRatio; c += kThreads) {
      const uint32_t j = 0xffffffffu - static_cast<uint32_t>(winners[c / kRatio]);
      out[c] = static_cast<int32_t>(int64_t(j) * kRatio + (c % kRatio));
    }
  }

  write_tail<kThreads>(out, kb, n, nb);
  if (tid == 0) {  // ready for the next call (and graph replay)
    counters[rl] = 0;
    if (dist_row) *maxkey = 0u;  // every CTA of the row read it before its second arrival
  }
}

// The launch's kernel, by key type, streamed rows and one page per chunk.
using KernelFn = void (*)(SelectParams, KeyDiv, int64_t, int64_t, uint32_t*, int32_t*,
                          uint32_t*, bool);

template <typename T, bool kStreamed, bool kPageChunks, int kThreads>
__global__ void __launch_bounds__(kThreads, Shape<kThreads>::kCtasPerSm)
    select_kernel(SelectParams p, KeyDiv cdiv, int64_t row0, int64_t ncap,
                  uint32_t* __restrict__ keys, int32_t* __restrict__ counters,
                  uint32_t* __restrict__ dist, bool pairs) {
  select_row<T, kStreamed, kPageChunks, kThreads>(p, cdiv, row0, ncap, keys, counters, dist,
                                                  pairs);
}

int64_t candidate_blocks(int64_t table_width, int64_t c) { return table_width * c; }

int64_t group_rows(int64_t rows, int64_t table_width, int64_t c) {
  const int64_t per_row = std::max<int64_t>(key_stride(candidate_blocks(table_width, c)), 4) * 4;
  int64_t g = static_cast<int64_t>(kWorkspaceCap / static_cast<size_t>(per_row));
  g = std::max<int64_t>(g, 1);
  g = std::min<int64_t>(g, kCounterSlots);
  return std::min<int64_t>(g, std::max<int64_t>(rows, 1));
}


template <typename T, int kThreads>
KernelFn typed_kernel(bool streamed, bool chunks) {
  return streamed ? (chunks ? select_kernel<T, true, true, kThreads>
                            : select_kernel<T, true, false, kThreads>)
                  : (chunks ? select_kernel<T, false, true, kThreads>
                            : select_kernel<T, false, false, kThreads>);
}

// NOTES (v49): a launch of float8 keys whose rows outnumber the SMs runs CTAs of 256 threads,
// two per SM, so that a row's select on one CTA overlaps the scoring of the other (one
// 512-thread CTA per SM loads no keys while it selects): ncu, H100, R = 256 / 160 0.970x /
// 0.966x. 2-byte keys keep 512 threads everywhere (bfloat16 R = 256 1.002x, float16 0.989x),
// as do smaller launches (NOTES-kernels.md, v49).
int select_threads(int64_t rows, int64_t sms, DType dtype) {
  return rows > sms && dtype == DType::kFloat8E4M3 ? 256 : 512;
}

template <typename T>
cudaError_t launch_typed(const cudaLaunchConfig_t& cfg, const SelectParams& p,
                         const KeyDiv& cdiv, int64_t row0, int64_t ncap, uint32_t* keys,
                         uint32_t* dist, bool pairs) {
  const bool chunks = page_chunks(p.keys_per_page), streamed = streamed_launch(ncap);
  KernelFn kernel = typed_kernel<T, 512>(streamed, chunks);
  if constexpr (sizeof(T) == 1) {  // float8 keys only (select_threads)
    if (cfg.blockDim.x == 256) kernel = typed_kernel<T, 256>(streamed, chunks);
  }
  return cudaLaunchKernelEx(&cfg, kernel, p, cdiv, row0, ncap, keys, p.counters, dist, pairs);
}

cudaError_t launch_select(const cudaLaunchConfig_t& cfg, const SelectParams& p,
                          const KeyDiv& cdiv, int64_t row0, int64_t ncap, uint32_t* keys,
                          uint32_t* dist, bool pairs) {
  switch (p.dtype) {
    case DType::kBFloat16:
      return launch_typed<__nv_bfloat16>(cfg, p, cdiv, row0, ncap, keys, dist, pairs);
    case DType::kFloat8E4M3:
      return launch_typed<__nv_fp8_e4m3>(cfg, p, cdiv, row0, ncap, keys, dist, pairs);
    default:
      return launch_typed<__half>(cfg, p, cdiv, row0, ncap, keys, dist, pairs);
  }
}

}  // namespace select_impl

using namespace select_impl;

// Rows of a group that can take the distributed select (v7p): 0 when no row can be streamed.
int64_t dist_rows(int64_t rows, int64_t table_width, int64_t c) {
  if (!streamed_launch(candidate_blocks(table_width, c))) return 0;
  return std::min<int64_t>(group_rows(rows, table_width, c), kDistRows);
}

size_t key_words(int64_t rows, int64_t table_width, int64_t c) {
  return static_cast<size_t>(group_rows(rows, table_width, c)) *
         static_cast<size_t>(key_stride(candidate_blocks(table_width, c)));
}

size_t select_workspace_bytes(int64_t rows, int64_t table_width, int64_t c) {
  if (rows <= 0 || table_width <= 0 || c <= 0) return 0;
  const size_t words = key_words(rows, table_width, c) +
                       static_cast<size_t>(dist_rows(rows, table_width, c)) * kDistWords;
  return words * sizeof(uint32_t);
}

// Arrivals, largest keys, then the pairs select's epoch counters.
int64_t select_counter_slots() { return kPairsSlot + kPairsMaxRows * kPairsSpread; }

int64_t select_launch_count(int64_t rows, int64_t table_width, int64_t c, DType /*dtype*/) {
  if (rows <= 0) return 0;
  const int64_t g = group_rows(rows, table_width, c);
  return (rows + g - 1) / g;
}

cudaError_t select_paged_tokens(const SelectParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  const int64_t c = p.keys_per_page;
  if (c <= 0 || c > (int64_t(1) << 30) || !detail::aligned16(p.compressed_keys)) {
    return cudaErrorInvalidValue;
  }
  const int64_t ncap = candidate_blocks(p.table_width, c);
  if (p.workspace_bytes < select_workspace_bytes(p.rows, p.table_width, c) ||
      p.counters == nullptr) {
    return cudaErrorInvalidValue;
  }
  uint32_t* keys = static_cast<uint32_t*>(p.workspace);
  const KeyDiv cdiv = make_key_div(padded_page(c));  // the loop's pages (v38)
  const int64_t g = group_rows(p.rows, p.table_width, c);
  const int64_t chunks = std::max<int64_t>(1, (ncap + kScoreChunk - 1) / kScoreChunk);
  // The SMs of the stream's partition (the device's, where it is not partitioned).
  const int64_t sm_count = detail::stream_sm_count(stream, detail::sm_count());
  for (int64_t row0 = 0; row0 < p.rows; row0 += g) {
    const int64_t n = std::min<int64_t>(g, p.rows - row0);
    // NOTES: up to one row per SM, one wave: the grid is at most one CTA per SM (short
    // CTAs in many waves each paid the 3-load chain before their keys: v6's R = 64 ran 10
    // waves), at least one CTA per row; CTAs loop over the remaining pages (the next
    // page-table entries load with the current keys). v7k: up to one CTA per page (a row of
    // few pages spreads its DRAM reads over twice the SMs; the L2-cold P8192 row read 64 KiB
    // per SM). v7n: more rows than SMs take 4 CTAs per row (several waves, so that a row's
    // select overlaps the other SMs' scoring instead of every SM selecting at once at the
    // end of a wave).
    // v32: float8 keys are half the bytes per CTA, so two CTAs per row instead of four (ncu,
    // H100, R = 256 at 32K: 2 CTAs 0.91x the time of 4, 8 CTAs 1.22x; bfloat16: 2 CTAs 0.99x).
    // v49: a launch of 256-thread CTAs has two per SM: each SM counts as two CTA slots, and
    // twice the CTAs per row hold the same warps.
    const int threads = select_threads(n, sm_count, p.dtype);
    const int64_t per_sm = 512 / threads, sms = sm_count * per_sm;
    const int64_t wide = (p.dtype == DType::kFloat8E4M3 ? kWideCtasFp8 : kWideCtas) * per_sm;
    // v57 (QSA_SELECT_ONE_WAVE): up to one row per CTA slot, one wave of one CTA per row.
    const int64_t spread_rows = QSA_SELECT_ONE_WAVE ? sms : sm_count;
    const int64_t per_row = n > spread_rows ? wide : std::max<int64_t>(1, sms / n);
    // v7w: a launch without streamed rows spreads a short row over up to one CTA per warp
    // chunk (16 blocks) instead of one per page.
    const int64_t ctas = std::min(
        streamed_launch(ncap) ? chunks : std::max<int64_t>(1, ncap / kWarpChunk), per_row);
    const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(n));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(static_cast<unsigned>(threads));
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    cfg.attrs = attr;
    if (p.pdl) attr[cfg.numAttrs++] = detail::pdl_attribute();
    // NOTES: the distributed select and the pairs select wait for the row's other CTAs: the
    // grid must be resident at once (cooperative; refused where it is not, and the call then
    // runs the last-CTA select). Rows at most one per SM of the stream's partition make at
    // most one CTA per SM.
    uint32_t* dist = nullptr;
    bool pairs = false;
    if (n <= sms && n <= dist_rows(p.rows, p.table_width, c) &&
        chunks <= kDistPages * (threads / kGroupThreads) * ctas) {
      dist = keys + key_words(p.rows, p.table_width, c);
    } else if (!streamed_launch(ncap) && !p.generic_path && n <= kPairsMaxRows &&
               n * ctas <= sms && ctas < int64_t(kPairsEpoch)) {
      pairs = true;
    }
    if (dist != nullptr || pairs) {
      attr[cfg.numAttrs].id = cudaLaunchAttributeCooperative;
      attr[cfg.numAttrs++].val.cooperative = 1;
    }
    cudaError_t err = launch_select(cfg, p, cdiv, row0, ncap, keys, dist, pairs);
    if (err == cudaErrorCooperativeLaunchTooLarge) {
      (void)cudaGetLastError();
      --cfg.numAttrs;  // the cooperative attribute is the last
      err = launch_select(cfg, p, cdiv, row0, ncap, keys, nullptr, false);
    }
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace qsa
