// RMSNorm kernels: one CTA per row, 16-byte vectors when the row allows, f32 statistics.
// The normalised value is rounded to the storage type before the weight multiplies it, as HF Llama's
// RMSNorm (and ops/norm.py's reference) does. The _q8 variants also write the output's int8 codes for the GGUF int8
// kernel that consumes it (q8_activation.cuh), saving that kernel its quantizer launch.
#include "cuda/common.cuh"
#include "cuda/norm.h"
#include "cuda/q8_activation.cuh"

namespace candle_vllm::cuda {
namespace {

// G: 0, or the scale group (32 or 256 values, q8_activation.cuh) of the int8 codes the kernel also writes.
template <typename T, int V, bool kFused, int G>
__global__ void rms_norm_kernel(T* __restrict__ out, T* __restrict__ x, T* __restrict__ residual,
                                const T* __restrict__ weight, int8_t* __restrict__ xq, gguf::XBlock* __restrict__ xb,
                                int hidden, float eps) {
  using Vt = Vec<T, V>;
  pdl_launch_dependents();
  const size_t row = blockIdx.x;
  const int nvec = hidden / V;
  const Vt* wv = reinterpret_cast<const Vt*>(weight);
  // The thread's first vector of the row is kept in registers for the second pass (the row's only one up to
  // blockDim vectors: 8192 bf16 values), and its weights are loaded before the wait (a model parameter, written at
  // load like the GEMVs' weights, never by the kernel before), so that pass waits on no memory.
  const bool first_live = static_cast<int>(threadIdx.x) < nvec;
  Vt held, w_first;
  if (first_live) w_first = wv[threadIdx.x];
  pdl_wait();
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
    if (i == static_cast<int>(threadIdx.x)) held = a;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float f = to_f32(a.v[j]);
      sq += f * f;
    }
  }
  const float inv = rsqrtf(block_sum(sq) / static_cast<float>(hidden) + eps);
  // Later trips (rows over blockDim vectors) re-read the row this CTA just touched (L1/L2 hits); each thread reads
  // what it wrote. Every thread takes the same number of trips (the code blocks' shuffles need the whole warp).
  const Vt* src = kFused ? res : xin;
  Vt* dst = reinterpret_cast<Vt*>((kFused ? x : out) + row * hidden);
  for (int base = 0; base < nvec; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const bool live = i < nvec;
    Vt o;
    if (live) {
      const Vt a = base == 0 ? held : src[i], wt = base == 0 ? w_first : wv[i];
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = from_f32<T>(round_to<T>(to_f32(a.v[j]) * inv) * to_f32(wt.v[j]));
      dst[i] = o;
    }
    if constexpr (G != 0) q8_store_vec<G>(o, live, xq, xb, row * hidden + static_cast<size_t>(i) * V);
  }
}

template <bool kFused>
void launch(void* out, void* x, void* residual, const void* weight, int8_t* xq, void* xb, int group, int64_t rows,
            int64_t hidden, float eps, DType dtype, std::uintptr_t stream) {
  if (rows == 0) return;
  const char* what = kFused ? (xq ? "fused_add_rms_norm_q8" : "fused_add_rms_norm") : (xq ? "rms_norm_q8" : "rms_norm");
  dispatch_float<true>(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const int threads = static_cast<int>(std::min<int64_t>(1024, ((hidden / kVec + 31) / 32) * 32));
    auto go = [&](auto kernel, int nthreads) {
      launch_pdl(what, kernel, dim3(static_cast<unsigned>(rows)), dim3(nthreads), 0, as_stream(stream),
                 static_cast<T*>(out), static_cast<T*>(x), static_cast<T*>(residual), static_cast<const T*>(weight),
                 xq, static_cast<gguf::XBlock*>(xb), static_cast<int>(hidden), eps);
    };
    const bool vec = hidden % kVec == 0 && aligned16(out, x, residual, weight);
    if (xq != nullptr) {
      if constexpr (sizeof(T) == 2) {
        if (!vec || (group != 32 && group != 256) || hidden % group != 0 || !aligned16(xq) ||
            reinterpret_cast<std::uintptr_t>(xb) % 8 != 0)
          throw std::invalid_argument(std::string(what) + ": needs a scale group of 32 or 256 values dividing hidden, "
                                      "16-byte aligned tensors and xq, 8-byte aligned xb");
        dispatch_q8_group(group, [&](auto g) { go(rms_norm_kernel<T, kVec, kFused, g>, std::max(32, threads)); });
        return;
      }
      throw std::invalid_argument(std::string(what) + ": int8 codes are written for f16/bf16 rows only");
    }
    if (vec) go(rms_norm_kernel<T, kVec, kFused, 0>, std::max(32, threads));
    else go(rms_norm_kernel<T, 1, kFused, 0>, static_cast<int>(std::min<int64_t>(1024, ((hidden + 31) / 32) * 32)));
  });
}

}  // namespace

void rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden, float eps, DType dtype,
              std::uintptr_t stream) {
  launch<false>(out, const_cast<void*>(x), nullptr, weight, nullptr, nullptr, 0, rows, hidden, eps, dtype, stream);
}

void fused_add_rms_norm(void* x, void* residual, const void* weight, int64_t rows, int64_t hidden, float eps,
                        DType dtype, std::uintptr_t stream) {
  launch<true>(nullptr, x, residual, weight, nullptr, nullptr, 0, rows, hidden, eps, dtype, stream);
}

void rms_norm_q8(void* out, int8_t* xq, void* xb, int group, const void* x, const void* weight, int64_t rows,
                 int64_t hidden, float eps, DType dtype, std::uintptr_t stream) {
  launch<false>(out, const_cast<void*>(x), nullptr, weight, xq, xb, group, rows, hidden, eps, dtype, stream);
}

void fused_add_rms_norm_q8(void* x, void* residual, int8_t* xq, void* xb, int group, const void* weight,
                           int64_t rows, int64_t hidden, float eps, DType dtype, std::uintptr_t stream) {
  launch<true>(nullptr, x, residual, weight, xq, xb, group, rows, hidden, eps, dtype, stream);
}

}  // namespace candle_vllm::cuda
