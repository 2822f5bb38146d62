// Register-level helpers of the skinny GEMM kernels (M <= 16 and M <= 64): streaming weight loads and the
// word view of a 16-byte fragment.
#pragma once
#include <cstdint>

namespace candle_vllm::cuda {

// Weights are read exactly once: keep them out of L1 so the activations stay there.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

}  // namespace candle_vllm::cuda
