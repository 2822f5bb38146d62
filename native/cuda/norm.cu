// RMSNorm kernels: one CTA per row, 16-byte vectors when the row allows, f32 statistics.
// The normalised value is rounded to the storage type before the weight multiplies it, as HF Llama's
// RMSNorm (and ops/norm.py's reference) does.
#include "cuda/common.cuh"
#include "cuda/norm.h"

namespace candle_vllm::cuda {
namespace {

template <typename T, int V, bool kFused>
__global__ void rms_norm_kernel(T* __restrict__ out, T* __restrict__ x, T* __restrict__ residual,
                                const T* __restrict__ weight, int hidden, float eps) {
  using Vt = Vec<T, V>;
  pdl_wait();
  const size_t row = blockIdx.x;
  const int nvec = hidden / V;
  const Vt* xin = reinterpret_cast<const Vt*>(x + row * hidden);
  Vt* res = reinterpret_cast<Vt*>(kFused ? residual + row * hidden : nullptr);
  float sq = 0.f;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vt a = xin[i];
    if constexpr (kFused) {
      const Vt b = res[i];
#pragma unroll
      for (int j = 0; j < V; ++j) a.v[j] = from_f32<T>(to_f32(a.v[j]) + to_f32(b.v[j]));
      res[i] = a;
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float f = to_f32(a.v[j]);
      sq += f * f;
    }
  }
  const float inv = rsqrtf(block_sum(sq) / static_cast<float>(hidden) + eps);
  pdl_launch_dependents();  // the next kernel's prologue overlaps the write pass
  // Second pass re-reads the row this CTA just touched (L1/L2 hits); each thread reads what it wrote.
  const Vt* src = kFused ? res : xin;
  Vt* dst = reinterpret_cast<Vt*>((kFused ? x : out) + row * hidden);
  const Vt* wv = reinterpret_cast<const Vt*>(weight);
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    const Vt a = src[i], wt = wv[i];
    Vt o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = from_f32<T>(round_to<T>(to_f32(a.v[j]) * inv) * to_f32(wt.v[j]));
    dst[i] = o;
  }
}

template <bool kFused>
void launch(void* out, void* x, void* residual, const void* weight, int64_t rows, int64_t hidden, float eps,
            DType dtype, std::uintptr_t stream) {
  if (rows == 0) return;
  dispatch_float<true>(dtype, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const int threads = static_cast<int>(std::min<int64_t>(1024, ((hidden / kVec + 31) / 32) * 32));
    auto go = [&](auto kernel, int nthreads) {
      launch_pdl(kFused ? "fused_add_rms_norm" : "rms_norm", kernel, dim3(static_cast<unsigned>(rows)), dim3(nthreads),
                 0, as_stream(stream), static_cast<T*>(out), static_cast<T*>(x), static_cast<T*>(residual),
                 static_cast<const T*>(weight), static_cast<int>(hidden), eps);
    };
    if (hidden % kVec == 0 && aligned16(out, x, residual, weight)) go(rms_norm_kernel<T, kVec, kFused>, std::max(32, threads));
    else go(rms_norm_kernel<T, 1, kFused>, static_cast<int>(std::min<int64_t>(1024, ((hidden + 31) / 32) * 32)));
  });
}

}  // namespace

void rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden, float eps, DType dtype,
              std::uintptr_t stream) {
  launch<false>(out, const_cast<void*>(x), nullptr, weight, rows, hidden, eps, dtype, stream);
}

void fused_add_rms_norm(void* x, void* residual, const void* weight, int64_t rows, int64_t hidden, float eps,
                        DType dtype, std::uintptr_t stream) {
  launch<true>(nullptr, x, residual, weight, rows, hidden, eps, dtype, stream);
}

}  // namespace candle_vllm::cuda
