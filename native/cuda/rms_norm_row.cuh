// The arithmetic of (fused add +) RMSNorm, shared by norm.cu's kernel and the skinny GEMM's add-norm tail
// (skinny_gemm.cu), so that a row gets the same bits whichever of them normalises it: the engine's batch
// invariance needs a decode step that took the fused path to match one that did not. Both files are compiled
// with the same flags (CMakeLists.txt), so the same expressions here give the same instructions (contraction of
// the square-sum into an FMA included).
//
// The sum of squares is order-sensitive: rms_norm_kernel runs rms_norm_threads(nvec) threads, thread t sums its
// vectors t, t + threads, ... element by element, then block_sum (common.cuh) folds each warp with warp_sum and
// the warps' sums with a second warp_sum. fused_add_rms_norm_rows replays exactly that virtual block with fewer
// real threads (a real warp plays several virtual warps, lane l always standing for virtual lane l).
#pragma once
#include "cuda/common.cuh"

namespace candle_vllm::cuda {

// Threads of rms_norm_kernel for a row of `units` vectors (or scalars): one warp at least, 1024 at most.
__host__ __device__ constexpr int rms_norm_threads(int64_t units) {
  return static_cast<int>(units >= 1024 ? 1024 : units <= 32 ? 32 : (units + 31) / 32 * 32);
}

// residual + x, rounded to the storage type (the new residual stream).
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> add_residual(Vec<T, V> a, const Vec<T, V> b) {
#pragma unroll
  for (int j = 0; j < V; ++j) a.v[j] = from_f32<T>(to_f32(a.v[j]) + to_f32(b.v[j]));
  return a;
}

template <typename T, int V>
__device__ __forceinline__ float add_squares(float sq, const Vec<T, V> a) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float f = to_f32(a.v[j]);
    sq += f * f;
  }
  return sq;
}

__device__ __forceinline__ float rms_inv(float sum_sq, int hidden, float eps) {
  return rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
}

// The normalised value rounded to T before the weight multiplies it (HF Llama's RMSNorm).
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> rms_scale(const Vec<T, V> a, const Vec<T, V> w, float inv) {
  Vec<T, V> o;
#pragma unroll
  for (int j = 0; j < V; ++j) o.v[j] = from_f32<T>(round_to<T>(to_f32(a.v[j]) * inv) * to_f32(w.v[j]));
  return o;
}

// fused_add_rms_norm over `rows` (<= kMaxRows) contiguous rows of `hidden` (% V == 0) elements by one CTA of
// kThreads threads, bit-identical to rms_norm_kernel<T, V, true>: residual = x + residual; x = norm(residual).
// x was written by other CTAs of this grid (the caller fenced and counted them): it is read through L2 (__ldcg).
// residual may come from an earlier kernel (the caller is past pdl_wait); plain loads. Loads are issued in
// batches of kBatch per thread so the few L2 round trips of a decode row are not serialised.
template <typename T, int V, int kThreads, int kMaxRows>
__device__ void fused_add_rms_norm_rows(T* __restrict__ x, T* residual, const T* __restrict__ weight, int rows,
                                        int hidden, float eps) {
  using Vt = Vec<T, V>;
  static_assert(sizeof(Vt) == 16, "rows are moved as 16-byte vectors");
  constexpr int kWarps = kThreads / 32, kBatch = 4;
  __shared__ float warp_sums[kMaxRows][32];
  __shared__ float inv[kMaxRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nvec = hidden / V;
  const int vthreads = rms_norm_threads(nvec), vwarps = vthreads / 32, trips = (nvec + vthreads - 1) / vthreads;
  const int pairs = rows * vwarps;  // (row, virtual warp) pairs, dealt round-robin to the real warps

  for (int p0 = warp; p0 < pairs; p0 += kWarps * kBatch) {
    float sq[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) sq[q] = 0.f;
    for (int trip = 0; trip < trips; ++trip) {
      Vt a[kBatch], b[kBatch];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        const int p = p0 + q * kWarps, row = p / vwarps, i = (p - row * vwarps) * 32 + lane + trip * vthreads;
        if (p < pairs && i < nvec) {
          const size_t at = static_cast<size_t>(row) * nvec + i;
          const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(x) + at);
          a[q] = *reinterpret_cast<const Vt*>(&raw);
          b[q] = reinterpret_cast<const Vt*>(residual)[at];
        }
      }
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        const int p = p0 + q * kWarps, row = p / vwarps, i = (p - row * vwarps) * 32 + lane + trip * vthreads;
        if (p < pairs && i < nvec) {
          a[q] = add_residual(a[q], b[q]);
          reinterpret_cast<Vt*>(residual)[static_cast<size_t>(row) * nvec + i] = a[q];
          sq[q] = add_squares(sq[q], a[q]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int p = p0 + q * kWarps;  // warp-uniform
      if (p >= pairs) break;
      const float s = warp_sum(sq[q]);
      if (lane == 0) warp_sums[p / vwarps][p % vwarps] = s;
    }
  }
  __syncthreads();
  for (int row = warp; row < rows; row += kWarps) {  // block_sum's second stage
    const float total = warp_sum(lane < vwarps ? warp_sums[row][lane] : 0.f);
    if (lane == 0) inv[row] = rms_inv(total, hidden, eps);
  }
  __syncthreads();  // also makes this CTA's residual stores visible to all its threads

  const int items = rows * nvec;
  for (int e0 = threadIdx.x; e0 < items; e0 += kThreads * kBatch) {
    Vt a[kBatch], w[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int e = e0 + q * kThreads;
      if (e < items) {
        a[q] = reinterpret_cast<const Vt*>(residual)[e];
        w[q] = reinterpret_cast<const Vt*>(weight)[e % nvec];
      }
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int e = e0 + q * kThreads;
      if (e < items) reinterpret_cast<Vt*>(x)[e] = rms_scale(a[q], w[q], inv[e / nvec]);
    }
  }
}

}  // namespace candle_vllm::cuda
