// Device side of deferred_norm.h: 1 / rms of a row, by one warp or by the whole CTA, with the f32 statistics of the
// RMSNorm kernels (norm.cu): rsqrt(sum(x^2) / hidden + eps).
#pragma once
#include "cuda/common.cuh"
#include "cuda/deferred_norm.h"

namespace candle_vllm::cuda {

// The norm as a kernel takes it: before_wait from CANDLE_VLLM_NORM_BEFORE_WAIT (an A/B switch, read once; 0 computes
// the scale after pdl_wait).
inline DeferredNorm for_launch(DeferredNorm n) {
  static const bool before_wait = env_switch_on("CANDLE_VLLM_NORM_BEFORE_WAIT");
  n.before_wait = before_wait;
  return n;
}

// Sum of squares of the row's 16-byte vectors first, first + step, ... (hidden % (16 / sizeof(T)) == 0). The loads
// go out kBatch at a time before any is used: a warp's share of a 4096-wide bf16 row is 16 vectors a lane, and
// one L2 round trip each, in turn, would cost more than the launch this spares.
// The rows are loaded through L2 only (.cg): they are read before pdl_wait (deferred_norm.h), and an SM's L1 may
// still hold lines of them from before their last write.
template <typename T>
__device__ __forceinline__ float row_sum_sq(const T* row, int hidden, int first, int step) {
  constexpr int V = 16 / sizeof(T), kBatch = 8;
  using Vt = Vec<T, V>;
  const uint4* vecs = reinterpret_cast<const uint4*>(row);
  const int n = hidden / V;
  float sq = 0.f;
  for (int base = first; base < n; base += kBatch * step) {
    Vt a[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * step;
      if (i < n) *reinterpret_cast<uint4*>(&a[b]) = __ldcg(vecs + i);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (base + b * step >= n) break;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float f = to_f32(a[b].v[j]);
        sq += f * f;
      }
    }
  }
  return sq;
}

// 1 / rms of token t's row, computed by the calling warp (all 32 lanes, every lane gets it).
template <typename T>
__device__ __forceinline__ float warp_inv_rms(const DeferredNorm& n, int64_t t) {
  const T* row = static_cast<const T*>(n.rows) + t * n.stride;
  const int hidden = static_cast<int>(n.hidden);
  return rsqrtf(warp_sum(row_sum_sq(row, hidden, threadIdx.x & 31, 32)) / static_cast<float>(hidden) + n.eps);
}

// 1 / rms of token t's row, computed by the whole CTA (every thread calls it and gets it).
template <typename T>
__device__ __forceinline__ float block_inv_rms(const DeferredNorm& n, int64_t t) {
  const T* row = static_cast<const T*>(n.rows) + t * n.stride;
  const int hidden = static_cast<int>(n.hidden);
  return rsqrtf(block_sum(row_sum_sq(row, hidden, threadIdx.x, blockDim.x)) / static_cast<float>(hidden) + n.eps);
}

}  // namespace candle_vllm::cuda
