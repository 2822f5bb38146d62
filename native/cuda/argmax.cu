// Row-wise argmax: one CTA per row; each thread scans a strided slice keeping (value, index), then warp and
// block reductions with the same ordering rule (larger value, or NaN, wins; equal values keep the lower index).
#include "cuda/argmax.h"
#include "cuda/common.cuh"

namespace candle_vllm::cuda {
namespace {

constexpr int kThreads = 1024;

struct Best {
  float v;
  int64_t i;
};

__device__ __forceinline__ bool beats(float a, int64_t ia, float b, int64_t ib) {
  const bool an = isnan(a), bn = isnan(b);
  if (an != bn) return an;
  if (an || a == b) return ia < ib;
  return a > b;
}

__device__ __forceinline__ void take(Best& best, float v, int64_t i) {
  if (beats(v, i, best.v, best.i)) best = {v, i};
}

template <typename T>
__global__ void __launch_bounds__(kThreads) argmax_kernel(int64_t* __restrict__ out, const T* __restrict__ logits,
                                                          int64_t vocab, bool vectorize) {
  const T* row = logits + static_cast<size_t>(blockIdx.x) * vocab;
  Best best{-INFINITY, vocab};  // loses to any real element
  constexpr int kVec = 16 / sizeof(T);
  const int64_t nvec = vectorize ? vocab / kVec : 0;
  const Vec<T, kVec>* rv = reinterpret_cast<const Vec<T, kVec>*>(row);
  for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
    const Vec<T, kVec> x = rv[i];
#pragma unroll
    for (int e = 0; e < kVec; ++e) take(best, to_f32(x.v[e]), i * kVec + e);
  }
  for (int64_t i = nvec * kVec + threadIdx.x; i < vocab; i += kThreads) take(best, to_f32(row[i]), i);

#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best.v, o);
    const int64_t i = __shfl_xor_sync(0xffffffffu, best.i, o);
    take(best, v, i);
  }
  __shared__ Best warp_best[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (warp == 0) {
    best = warp_best[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, best.v, o);
      const int64_t i = __shfl_xor_sync(0xffffffffu, best.i, o);
      take(best, v, i);
    }
    if (lane == 0) out[blockIdx.x] = best.i;
  }
}

}  // namespace

void argmax_rows(int64_t* out, const void* logits, int64_t rows, int64_t vocab, DType dtype, std::uintptr_t stream) {
  if (vocab < 1) throw std::invalid_argument("argmax_rows: vocab must be >= 1");
  if (rows == 0) return;
  dispatch_float<true>(dtype, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const bool vectorize = vocab % (16 / sizeof(T)) == 0 && aligned16(logits);
    argmax_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, as_stream(stream)>>>(out, static_cast<const T*>(logits),
                                                                                      vocab, vectorize);
  });
  check_launch("argmax_rows");
}

}  // namespace candle_vllm::cuda
