// Device helpers shared by the QSA kernels (internal; not part of the interface).
#pragma once

#include <cuda.h>  // the driver's types only: its entry points are resolved at run time
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace qsa {
namespace detail {

// The device's SM count (device < 0: the current device); 132, the H100/H200 count, where the
// query fails.
inline int sm_count(int device = -1) {
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return 132;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 132;
  }
  return sms > 0 ? sms : 132;
}

// The two driver calls that tell a stream's SM partition (CUDA 12.4+ drivers), resolved once
// through the runtime, so that the library links no driver library; null where the driver
// has none.
struct GreenCtxApi {
  CUresult (*stream_green_ctx)(CUstream, CUgreenCtx*) = nullptr;
  CUresult (*green_ctx_resource)(CUgreenCtx, CUdevResource*, CUdevResourceType) = nullptr;
};

inline const GreenCtxApi& green_ctx_api() {
  static const GreenCtxApi api = [] {
    GreenCtxApi a;
    void* f = nullptr;
    void* g = nullptr;
    cudaDriverEntryPointQueryResult qf = cudaDriverEntryPointSymbolNotFound;
    cudaDriverEntryPointQueryResult qg = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuStreamGetGreenCtx", &f, 12040, cudaEnableDefault,
                                         &qf) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuGreenCtxGetDevResource", &g, 12040,
                                         cudaEnableDefault, &qg) == cudaSuccess &&
        qf == cudaDriverEntryPointSuccess && qg == cudaDriverEntryPointSuccess && f && g) {
      a.stream_green_ctx = reinterpret_cast<decltype(a.stream_green_ctx)>(f);
      a.green_ctx_resource = reinterpret_cast<decltype(a.green_ctx_resource)>(g);
    }
    (void)cudaGetLastError();
    return a;
  }();
  return api;
}

// The SMs a launch on `stream` runs on: the SM count of the stream's green context where it
// belongs to one (a partitioned device; for the NULL and legacy streams, the green context
// current on this thread), else `whole` (the device's, sm_count()). Grids that must be
// resident at once (cooperative launches) are sized by this, not by the device: a cooperative
// launch captured into a graph is not refused there the way an eager one is, and its CTAs
// would wait at replay for CTAs that never become resident (NOTES-kernels.md, "The ops on a
// partitioned device").
inline int stream_sm_count(cudaStream_t stream, int whole) {
  const GreenCtxApi& api = green_ctx_api();
  if (api.stream_green_ctx == nullptr) return whole;
  CUgreenCtx green = nullptr;
  if (api.stream_green_ctx(reinterpret_cast<CUstream>(stream), &green) != CUDA_SUCCESS ||
      green == nullptr) {
    return whole;
  }
  CUdevResource r = {};
  if (api.green_ctx_resource(green, &r, CU_DEV_RESOURCE_TYPE_SM) != CUDA_SUCCESS) return whole;
  const int n = static_cast<int>(r.sm.smCount);
  return n > 0 && n < whole ? n : whole;
}

// NOTES (PDL): a load marked read-only (ld.global.nc: __ldg, the helpers below, a const
// __restrict__ pointer) may be moved by ptxas above griddepcontrol.wait, as if its data could
// not change while the kernel runs, and under PDL the kernel before may still be writing it:
// the streamed select kernels loaded token_to_req ahead of the wait (SASS). So a kernel's
// first loads, whose addresses come from its parameters and thread ids alone, are coherent
// loads (kFirst: plain ld.global, kept behind the wait); every other load takes its address
// from one of them and cannot move above it. tests/gpu checks the SASS of every kernel.
constexpr bool kFirst = true;

__device__ __forceinline__ uint16_t ld16(const unsigned short* p) {
  uint16_t v;
  asm volatile("ld.global.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}

// Eight consecutive halves. kVec16: one 16-byte load (the pointer is 16-byte aligned);
// otherwise eight 2-byte loads, for tensors whose storage offset breaks that alignment.
// kFirstLoad: coherent loads (ld.global), see the PDL note above; else ld.global.nc.
template <bool kVec16, bool kFirstLoad = false>
__device__ __forceinline__ uint4 load8(const __half* p) {
  if constexpr (kVec16 && kFirstLoad) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  } else if constexpr (kVec16) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = kFirstLoad ? ld16(s + 2 * i) : __ldg(s + 2 * i);
      const uint32_t hi = kFirstLoad ? ld16(s + 2 * i + 1) : __ldg(s + 2 * i + 1);
      w[i] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

__device__ __forceinline__ void half8_to_float(const uint4& raw, float (&f)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// Loads issued where they are written: asm volatile keeps the compiler from sinking a load to
// its first use (it did so for predicated zero-filled loads, one round trip per load) and from
// turning the predicate into a branch. Zero / `fallback` when `pred` is false, and then
// nothing is read. kFirstLoad: a coherent load (ld.global), see the PDL note above; else a
// read-only load (ld.global.nc). The macros spell each load once, with the cache qualifier
// `nc` ("" or ".nc") spliced in.
#define QSA_LDG16_PRED(nc)                                                               \
  asm volatile("{\n\t.reg .pred q;\n\t"                                                  \
               "setp.ne.b32 q, %5, 0;\n\t"                                               \
               "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"     \
               "@q ld.global" nc ".v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"                  \
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                              \
               : "l"(p), "r"(int(pred)))
#define QSA_LDG32_PRED(nc)                                  \
  asm volatile("{\n\t.reg .pred q;\n\t"                     \
               "setp.ne.b32 q, %2, 0;\n\t"                  \
               "mov.b32 %0, %3;\n\t"                        \
               "@q ld.global" nc ".b32 %0, [%1];\n\t}"       \
               : "=r"(v)                                    \
               : "l"(p), "r"(int(pred)), "r"(fallback))

// 16 bytes, read-only path, unpredicated (asm volatile: issued where written, not sunk toward
// the first use).
// kOff: a byte offset in the instruction (p + kOff without an address add per load).
template <int kOff = 0>
__device__ __forceinline__ uint4 ldg16_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4+%5];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "n"(kOff));
  return v;
}

// 16 bytes global -> shared without registers (cp.async, L2 only), in the thread's current
// group; cp_async_commit closes the group, cp_async_wait<N> waits until at most N of the
// thread's groups are pending (the data then visible to the thread; __syncwarp for its warp).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

template <bool kFirstLoad = false>
__device__ __forceinline__ uint4 ldg16_pred(const void* p, bool pred) {
  uint4 v;
  if constexpr (kFirstLoad) {
    QSA_LDG16_PRED("");
  } else {
    QSA_LDG16_PRED(".nc");
  }
  return v;
}

// A read-only 16-byte load predicated on pred; v keeps its value when off (the selection's
// branch-free chunk step, v44).
__device__ __forceinline__ void ldg16_keep(const void* p, bool pred, uint4& v) {
  asm("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
      "@q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(p), "r"(int(pred)));
}

template <bool kFirstLoad = false>
__device__ __forceinline__ int32_t ldg32_pred(const int32_t* p, bool pred, int32_t fallback) {
  int32_t v;
  if constexpr (kFirstLoad) {
    QSA_LDG32_PRED("");
  } else {
    QSA_LDG32_PRED(".nc");
  }
  return v;
}
#define QSA_LDG8_PRED(nc)                                                        \
  asm volatile("{\n\t.reg .pred q;\n\t"                                          \
               "setp.ne.b32 q, %3, 0;\n\t"                                       \
               "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\t"                            \
               "@q ld.global" nc ".v2.u32 {%0, %1}, [%2];\n\t}"                   \
               : "=r"(v.x), "=r"(v.y)                                             \
               : "l"(p), "r"(int(pred)))
// Eight bytes (an 8-byte aligned address), predicated: zero when !pred.
template <bool kFirstLoad = false>
__device__ __forceinline__ uint2 ldg8_pred(const void* p, bool pred) {
  uint2 v;
  if constexpr (kFirstLoad) {
    QSA_LDG8_PRED("");
  } else {
    QSA_LDG8_PRED(".nc");
  }
  return v;
}
#undef QSA_LDG16_PRED
#undef QSA_LDG32_PRED
#undef QSA_LDG8_PRED

template <bool kFirstLoad = false>
__device__ __forceinline__ int64_t ldg64(const int64_t* p) {
  int64_t v;
  if constexpr (kFirstLoad) {
    asm volatile("ld.global.b64 %0, [%1];\n" : "=l"(v) : "l"(p));
  } else {
    asm volatile("ld.global.nc.b64 %0, [%1];\n" : "=l"(v) : "l"(p));
  }
  return v;
}

// Eight halves, predicated: one 16-byte load (kVec16) or eight 2-byte loads; zero when !pred.
template <bool kVec16, bool kFirstLoad = false>
__device__ __forceinline__ uint4 load8_pred(const __half* p, bool pred) {
  if constexpr (kVec16) {
    return ldg16_pred<kFirstLoad>(p, pred);
  } else {
    return pred ? load8<false, kFirstLoad>(p) : make_uint4(0, 0, 0, 0);
  }
}

// ---- Element types (contract v2) -----------------------------------------------------------
// The kernels are templated on the element type of their tensors: __half, __nv_bfloat16 and
// (K/V caches, the indexer) __nv_fp8_e4m3. Eight consecutive elements are one "raw" word:
// uint4 for the 2-byte types, uint2 for fp8; to_float8 widens them exactly to float32.
template <typename T>
struct Elem;
template <>
struct Elem<__half> {
  using Raw = uint4;
  static constexpr int kBytes = 2;
  __device__ static __forceinline__ void to_float8(const uint4& raw, float (&f)[8]) {
    half8_to_float(raw, f);
  }
  __device__ static __forceinline__ float to_float(uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
  }
  __device__ static __forceinline__ uint16_t from_float(float v) {
    return __half_as_ushort(__float2half_rn(v));
  }
};
template <>
struct Elem<__nv_bfloat16> {
  using Raw = uint4;
  static constexpr int kBytes = 2;
  __device__ static __forceinline__ void to_float8(const uint4& raw, float (&f)[8]) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static __forceinline__ float to_float(uint16_t bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
  __device__ static __forceinline__ uint16_t from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};
// Four fp8-e4m3 values (one word) as two half2, exactly (cvt.rn.f16x2.e4m3x2; the low byte
// first): bytes 0-1 (.x) and 2-3 (.y). NOTES (v36): the halves of the word as .b16 operands,
// so that the high pair's conversion reads R.H1 (F2FP ... UNPACK_B R, R.H1) instead of a
// shift first: one instruction per pair.
__device__ __forceinline__ uint2 fp8x4_to_half4(uint32_t four) {
  uint2 h;
  asm("{\n\t.reg .b16 l, u;\n\tmov.b32 {l, u}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, u;\n\t}"
      : "=r"(h.x), "=r"(h.y)
      : "r"(four));
  return h;
}
// Eight fp8-e4m3 values as eight halves (exact: every e4m3 value is a float16).
__device__ __forceinline__ uint4 fp8x8_to_half8(const uint2& raw) {
  const uint2 a = fp8x4_to_half4(raw.x), b = fp8x4_to_half4(raw.y);
  return make_uint4(a.x, a.y, b.x, b.y);
}
template <>
struct Elem<__nv_fp8_e4m3> {
  using Raw = uint2;
  static constexpr int kBytes = 1;
  __device__ static __forceinline__ void to_float8(const uint2& raw, float (&f)[8]) {
    half8_to_float(fp8x8_to_half8(raw), f);
  }
};

// Eight elements of a 16-byte (2-byte types) or 8-byte (fp8) aligned address, predicated.
template <typename T, bool kFirstLoad = false>
__device__ __forceinline__ typename Elem<T>::Raw load_raw8(const T* p, bool pred) {
  if constexpr (Elem<T>::kBytes == 2) {
    return ldg16_pred<kFirstLoad>(p, pred);
  } else {
    return ldg8_pred<kFirstLoad>(p, pred);
  }
}

// Eight 2-byte elements, coherent (a kernel's first loads), at any 2-byte aligned address:
// one 16-byte load where the address allows it (`vec16`, uniform), else eight 2-byte loads.
__device__ __forceinline__ uint4 load8_first_any(const void* p, bool vec16, bool pred) {
  if (vec16) return ldg16_pred<true>(p, pred);
  if (!pred) return make_uint4(0, 0, 0, 0);
  return load8<false, true>(static_cast<const __half*>(p));
}

// Last-CTA patterns: a barrier, then this by one thread (release of the CTA's writes, acquire
// of the earlier arrivals').
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int32_t* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

// Release of the CTA's writes (after a barrier, by one thread), without waiting for a value.
__device__ __forceinline__ void red_add_release_gpu(int32_t* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_acquire_gpu(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Epoch counters: a counter that is never reset. Every call adds exactly `epoch` (a power of
// two, at least the call's arrivals) to it: the first CTA adds 1 + epoch - arrivals, every
// other CTA 1 (epoch_add), so it holds a multiple of epoch between calls. An arrival that
// returns the value before it knows the value that completes its call (its epoch base plus
// epoch) and epoch_wait waits for that, comparing by a signed difference (2^32 is a multiple
// of epoch: the wrap is harmless). Nobody has to count out again and reset the counter.
__device__ __forceinline__ int epoch_add(bool first, int arrivals, uint32_t epoch) {
  return first ? 1 + static_cast<int>(epoch) - arrivals : 1;
}
__device__ __forceinline__ void epoch_wait(const int32_t* counter, uint32_t before,
                                           uint32_t epoch) {
  const uint32_t done = (before & ~(epoch - 1)) + epoch;
  while (static_cast<int32_t>(static_cast<uint32_t>(ld_acquire_gpu(counter)) - done) < 0) {
  }
}

// Programmatic dependent launch (PDL). A kernel launched with it (pdl_attribute) may start
// while the kernel before it in the stream still runs: grid_dependency_wait() returns once
// that kernel has completed and its writes are visible, so every kernel calls it before its
// first global read or write. allow_dependents() lets the next kernel's CTAs start (and wait)
// as this CTA's SM frees up: every CTA calls it once its own heavy traffic is issued. Both
// are no-ops in a launch without the attribute.
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void allow_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

__host__ __device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// mma.sync m16n8k16, f32 accumulate. kBf16: bfloat16 inputs, else float16 (the selection's
// fp16 keys and fp8 keys widened exactly to fp16; the attention's fp8 K/V).
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// NOTES (v33): independent accumulator chains of an mma sequence (k-step u into chain
// u % kChains), zeroed before and summed after, so that the mma need not wait on each other.
template <int kChains>
__device__ __forceinline__ void zero_chains(float (&part)[kChains][4]) {
#pragma unroll
  for (int c = 0; c < kChains; ++c) part[c][0] = part[c][1] = part[c][2] = part[c][3] = 0.f;
}
template <int kChains>
__device__ __forceinline__ void sum_chains(const float (&part)[kChains][4], float (&acc)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    acc[e] = part[0][e];
#pragma unroll
    for (int c = 1; c < kChains; ++c) acc[e] += part[c][e];
  }
}

// Word i of a 16-byte register group.
__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

}  // namespace detail
}  // namespace qsa
