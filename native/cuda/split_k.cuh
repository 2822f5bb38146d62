// Serial split-K for the decode GEMMs (skinny_gemm.cu, skinny_gemm_kn.cu): the CTAs that share an output tile each
// sum one part of K, and the last of them to finish adds all parts, in part order, so no second launch is needed.
#pragma once
#include <cstddef>

namespace candle_vllm::cuda {

// Every CTA of the tile writes its sums (element r at offset at[r] of one part's M x N block of `partials`, where
// valid[r]) and counts itself in *counter; the last to arrive reads all parts' sums back through L2 and leaves the
// totals in `sums`, and *counter at zero for the next launch. Returns whether this CTA is that last one (the others
// are done). Every thread of the CTA calls it; `split` / `splits` are this CTA's part and the number of parts.
template <int kPer>
__device__ __forceinline__ bool serial_split_k(float (&sums)[kPer], const size_t (&at)[kPer],
                                               const bool (&valid)[kPer], float* partials, size_t part_stride,
                                               int* counter, int split, int splits) {
#pragma unroll
  for (int r = 0; r < kPer; ++r)
    if (valid[r]) partials[split * part_stride + at[r]] = sums[r];
  __threadfence();
  __syncthreads();
  __shared__ bool is_last;
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == splits - 1;
  __syncthreads();
  if (!is_last) return false;
  __threadfence();
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    if (!valid[r]) continue;
    float sum = 0.f;
    for (int p = 0; p < splits; ++p) sum += __ldcg(&partials[p * part_stride + at[r]]);
    sums[r] = sum;
  }
  if (threadIdx.x == 0) *counter = 0;
  return true;
}

}  // namespace candle_vllm::cuda
