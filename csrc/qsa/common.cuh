// Device helpers shared by the QSA kernels (internal; not part of the interface).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace qsa {
namespace detail {

// Eight consecutive halves. kVec16: one 16-byte load (the pointer is 16-byte aligned);
// otherwise eight 2-byte loads, for tensors whose storage offset breaks that alignment.
template <bool kVec16>
__device__ __forceinline__ uint4 load8(const __half* p) {
  if constexpr (kVec16) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = uint32_t(__ldg(s + 2 * i)) | (uint32_t(__ldg(s + 2 * i + 1)) << 16);
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

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace detail
}  // namespace qsa
