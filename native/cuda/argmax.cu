// Row-wise argmax, split over several CTAs per row so one row (batch-1 decode, 128k vocabularies) spreads over
// the GPU: each CTA scans a slice keeping (value, index), reduces it in the warp and the block, and merges its
// winner into out[row] with one 64-bit atomicMax on an order-preserving key; a last tiny kernel turns the keys
// into indices. Same ordering rule everywhere: the larger value wins, NaN beats everything, equal values keep
// the lower index (torch.argmax).
#include "cuda/argmax.h"
#include "cuda/common.cuh"

namespace candle_vllm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMinSlice = 2048;  // elements per CTA at least: below it the atomics outweigh the scan
constexpr int kLoads = 4;            // 16-byte loads a thread issues before scanning them

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

// Larger key <=> beats(): the value's bits made monotone (NaN on top, -0 == +0) above the complemented index.
__device__ __forceinline__ unsigned long long key_of(const Best& b) {
  uint32_t hi;
  if (isnan(b.v)) {
    hi = 0xFFFFFFFFu;
  } else {
    const uint32_t bits = __float_as_uint(b.v == 0.f ? 0.f : b.v);
    hi = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
  }
  return static_cast<unsigned long long>(hi) << 32 | (0xFFFFFFFFu - static_cast<uint32_t>(b.i));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) argmax_slices_kernel(unsigned long long* __restrict__ keys,
                                                                 const T* __restrict__ logits, int64_t vocab,
                                                                 int64_t slice, bool vectorize) {
  const T* row = logits + static_cast<size_t>(blockIdx.y) * vocab;
  const int64_t begin = blockIdx.x * slice, end = min(vocab, begin + slice);
  Best best{-INFINITY, vocab};  // loses to any real element
  constexpr int kVec = 16 / sizeof(T);
  // slice is a multiple of kVec, so a vectorized slice starts aligned.
  const int64_t vec_end = vectorize ? begin + (end - begin) / kVec * kVec : begin;
  const Vec<T, kVec>* rv = reinterpret_cast<const Vec<T, kVec>*>(row + begin);
  const int64_t nvec = (vec_end - begin) / kVec;
  int64_t i = threadIdx.x;
  // kLoads vectors in flight per thread: one at a time, the scan waits a DRAM round trip per vector.
  for (; i + (kLoads - 1) * kThreads < nvec; i += kLoads * kThreads) {
    Vec<T, kVec> x[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) x[u] = rv[i + u * kThreads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
#pragma unroll
      for (int e = 0; e < kVec; ++e) take(best, to_f32(x[u].v[e]), begin + (i + u * kThreads) * kVec + e);
  }
  for (; i < nvec; i += kThreads) {
    const Vec<T, kVec> x = rv[i];
#pragma unroll
    for (int e = 0; e < kVec; ++e) take(best, to_f32(x.v[e]), begin + i * kVec + e);
  }
  for (int64_t i = vec_end + threadIdx.x; i < end; i += kThreads) take(best, to_f32(row[i]), i);

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
  if (warp != 0) return;
  best = lane < kThreads / 32 ? warp_best[lane] : Best{-INFINITY, vocab};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best.v, o);
    const int64_t i = __shfl_xor_sync(0xffffffffu, best.i, o);
    take(best, v, i);
  }
  if (lane == 0 && best.i < vocab) atomicMax(keys + blockIdx.y, key_of(best));
}

__global__ void keys_to_indices_kernel(int64_t* __restrict__ out, int64_t rows) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < rows) {
    const unsigned long long key = reinterpret_cast<const unsigned long long*>(out)[r];
    out[r] = 0xFFFFFFFFu - static_cast<uint32_t>(key & 0xFFFFFFFFull);
  }
}

}  // namespace

void argmax_rows(int64_t* out, const void* logits, int64_t rows, int64_t vocab, DType dtype, std::uintptr_t stream) {
  if (vocab < 1 || vocab > 0xFFFFFFFFll) throw std::invalid_argument("argmax_rows: vocab must be in 1..2^32-1");
  if (rows == 0) return;
  if (rows > 65535) throw std::invalid_argument("argmax_rows: at most 65535 rows per call");
  const cudaStream_t s = as_stream(stream);
  // About two CTAs per SM over the whole batch, each slice a whole number of 16-byte vectors.
  const int64_t want = std::max<int64_t>(1, (2 * device_sm_count() + rows - 1) / rows);
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(want, vocab / kMinSlice));
  const int64_t slice = ((vocab + splits - 1) / splits + 7) / 8 * 8;
  const dim3 grid(static_cast<unsigned>((vocab + slice - 1) / slice), static_cast<unsigned>(rows));
  auto* keys = reinterpret_cast<unsigned long long*>(out);
  check_cuda(cudaMemsetAsync(out, 0, static_cast<size_t>(rows) * sizeof(int64_t), s), "argmax_rows: clear keys");
  dispatch_float<true>(dtype, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const bool vectorize = aligned16(logits) && (vocab * sizeof(T)) % 16 == 0;
    argmax_slices_kernel<T><<<grid, kThreads, 0, s>>>(keys, static_cast<const T*>(logits), vocab, slice, vectorize);
  });
  keys_to_indices_kernel<<<static_cast<unsigned>((rows + 255) / 256), 256, 0, s>>>(out, rows);
  check_launch("argmax_rows");
}

}  // namespace candle_vllm::cuda
