// Cache update: update_caches (contract section 3).
//
// Two launches on one stream:
//  1. write_kv: one warp per row; a valid slot s gets the row's 256 K halves then its 256 V
//     halves at kv + s * 512 (lane L moves halves [8L, 8L + 8) of each).
//  2. compress: one CTA per row; a row with a valid slot and a valid compressed slot computes
//     its block's compressed key from the 4 cached keys (written by launch 1 or by an earlier
//     call): m[d] = (((K0 + K1) + K2) + K3) * 0.25, then for each of the 128 outputs (one warp
//     each, 8 warps x 16) the products W[i, d] * m[d] and the contract's halving folds
//     (h = 128, 64, 32 inside a lane: lane L holds d = L + 32k; h = 16 .. 1 across lanes with
//     xor shuffles, where commutativity gives every lane the same sum). Every operation is an
//     explicit round-to-nearest intrinsic (__fadd_rn / __fmul_rn), so nothing is contracted
//     into an FMA and the result is bit-identical to the PyTorch reference.
// Nothing is allocated or read back; grid sizes depend on T only (graph-capturable).
#include <cuda_fp16.h>

#include <cstdint>

#include "common.cuh"
#include "qsa.h"

namespace qsa {
// NOTES: a named namespace, not an anonymous one (see sparse_paged_attention.cu).
namespace update_impl {

using detail::aligned16;
using detail::load8;

constexpr int kHeadDim = QSA_HEAD_DIM;        // 256
constexpr int kKvPage = QSA_KV_PAGE;          // 512 tokens per page
constexpr int kCkPage = QSA_CK_PAGE;          // 128 compressed keys per page
constexpr int kIndexDim = QSA_INDEX_DIM;      // 128 outputs per compressed key
constexpr int kRatio = QSA_COMPRESS_RATIO;    // 4 tokens per block
constexpr int kTokenHalves = 2 * kHeadDim;    // K then V
constexpr int kLanes = 32;
constexpr int kPerLane = kHeadDim / kLanes;   // 8 dims per lane
static_assert(kHeadDim == kLanes * 8, "a lane moves one 16-byte vector of K and one of V");
static_assert(kRatio == 4, "the mean is written out for 4 keys");
static_assert(kPerLane == 8, "the in-lane folds are written out for 8 values");
static_assert(kKvPage % kRatio == 0, "a block never straddles a page");

constexpr int kWriteThreads = 256;
constexpr int kRowsPerWriteCta = kWriteThreads / kLanes;  // 8
constexpr int kCompressThreads = 256;
constexpr int kCompressWarps = kCompressThreads / kLanes;  // 8
// NOTES: one output per warp, so grid.y = 16 CTAs share a row's 128 outputs: with a loop of
// 16 outputs per warp in one CTA the weight loads formed a chain of DRAM round trips
// (11 us per decode layer at R = 1, measured on the H200); each CTA now reads the block's 4
// keys (2 KiB, from L2 after the first) and 8 weight rows, all loads issued at once.
constexpr int kCompressSlices = kIndexDim / kCompressWarps;  // 16
static_assert(kIndexDim % kCompressWarps == 0, "outputs split evenly over the warps");

template <bool kVec16>
__device__ __forceinline__ void store8(__half* p, const uint4& v) {
  if constexpr (kVec16) {
    *reinterpret_cast<uint4*>(p) = v;
  } else {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(&v);
    unsigned short* d = reinterpret_cast<unsigned short*>(p);
#pragma unroll
    for (int i = 0; i < 8; ++i) d[i] = s[i];
  }
}

template <bool kVec16>
__global__ void __launch_bounds__(kWriteThreads)
    write_kv_kernel(const __half* __restrict__ key, const __half* __restrict__ value,
                    const int64_t* __restrict__ slots, __half* __restrict__ kv, int64_t rows,
                    int64_t pages) {
  detail::grid_dependency_wait();  // before the first global access (a launch with pdl)
  const int lane = threadIdx.x % kLanes;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerWriteCta + threadIdx.x / kLanes;
  if (row >= rows) return;
  // The first loads are coherent (detail::kFirst): nothing may move above the wait.
  const int64_t s = detail::ldg64<detail::kFirst>(slots + row);
  if (s < 0 || s >= pages * kKvPage) return;  // padded (-1) or out of range: skipped
  const uint4 k = load8<kVec16, detail::kFirst>(key + row * kHeadDim + lane * 8);
  const uint4 v = load8<kVec16, detail::kFirst>(value + row * kHeadDim + lane * 8);
  __half* dst = kv + s * kTokenHalves;
  store8<kVec16>(dst + lane * 8, k);
  store8<kVec16>(dst + kHeadDim + lane * 8, v);
}

__global__ void __launch_bounds__(kCompressThreads)
    compress_kernel(const __half* __restrict__ kv, const int64_t* __restrict__ slots,
                    const int64_t* __restrict__ ck_slots, const float* __restrict__ wk,
                    __half* __restrict__ ck, int64_t pages, int64_t ck_pages) {
  detail::grid_dependency_wait();  // the K/V rows of write_kv_kernel are visible after it
  const int64_t row = blockIdx.x;
  const int64_t s = detail::ldg64<detail::kFirst>(slots + row);  // coherent: see write_kv_kernel
  const int64_t c = detail::ldg64<detail::kFirst>(ck_slots + row);
  if (s < 0 || s >= pages * kKvPage || c < 0 || c >= ck_pages * kCkPage) return;
  const int lane = threadIdx.x % kLanes;
  const int warp = threadIdx.x / kLanes;
  const __half* block = kv + (s / kRatio) * kRatio * kTokenHalves;  // token 0 of the block
  float m[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int d = lane + kLanes * k;
    const float k0 = __half2float(block[0 * kTokenHalves + d]);
    const float k1 = __half2float(block[1 * kTokenHalves + d]);
    const float k2 = __half2float(block[2 * kTokenHalves + d]);
    const float k3 = __half2float(block[3 * kTokenHalves + d]);
    m[k] = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(k0, k1), k2), k3), 0.25f);
  }
  __half* out = ck + c * kIndexDim;
  {
    const int i = blockIdx.y * kCompressWarps + warp;  // this warp's output
    const float* w = wk + int64_t(i) * kHeadDim;
    float p[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {  // coherent, as the first loads: see write_kv_kernel
      const int32_t* wi = reinterpret_cast<const int32_t*>(w + lane + kLanes * k);
      p[k] = __fmul_rn(__int_as_float(detail::ldg32_pred<detail::kFirst>(wi, true, 0)), m[k]);
    }
    // h = 128: d and d + 128 are k and k + 4 of one lane; h = 64: k and k + 2; h = 32: k, k + 1
    const float q0 = __fadd_rn(p[0], p[4]), q1 = __fadd_rn(p[1], p[5]);
    const float q2 = __fadd_rn(p[2], p[6]), q3 = __fadd_rn(p[3], p[7]);
    const float r0 = __fadd_rn(q0, q2), r1 = __fadd_rn(q1, q3);
    float t = __fadd_rn(r0, r1);  // lane L: the partial sum of d = L (mod 32)
#pragma unroll
    for (int h = kLanes / 2; h >= 1; h /= 2) {
      t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, h));
    }
    if (lane == 0) out[i] = __float2half_rn(t);
  }
}

}  // namespace update_impl

int64_t update_launch_count(int64_t rows) { return rows > 0 ? 2 : 0; }

cudaError_t update_caches(const UpdateParams& p, cudaStream_t stream) {
  using namespace update_impl;
  if (p.rows <= 0) return cudaSuccess;
  const __half* key = static_cast<const __half*>(p.key);
  const __half* value = static_cast<const __half*>(p.value);
  __half* kv = static_cast<__half*>(p.kv);
  cudaLaunchAttribute attr[1] = {detail::pdl_attribute()};
  cudaLaunchConfig_t cfg = {};
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  {  // rows with no valid slot (P == 0 included) return at once: the grid depends on T only
    cfg.gridDim = dim3(unsigned((p.rows + kRowsPerWriteCta - 1) / kRowsPerWriteCta));
    cfg.blockDim = dim3(kWriteThreads);
    const bool vec16 = aligned16(key) && aligned16(value) && aligned16(kv);
    auto* kernel = vec16 ? write_kv_kernel<true> : write_kv_kernel<false>;
    cudaError_t err =
        cudaLaunchKernelEx(&cfg, kernel, key, value, p.slot_mapping, kv, p.rows, p.pages);
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  cfg.gridDim = dim3(unsigned(p.rows), kCompressSlices);
  cfg.blockDim = dim3(kCompressThreads);
  cudaError_t err = cudaLaunchKernelEx(&cfg, compress_kernel, kv, p.slot_mapping,
                                       p.compressed_slot_mapping, p.index_wk,
                                       static_cast<__half*>(p.compressed_keys), p.pages,
                                       p.compressed_pages);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace qsa
