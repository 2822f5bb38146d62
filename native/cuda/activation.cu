// SiLU-and-mul (SwiGLU) over the fused gate/up projection: one read of each input, one write, f32 maths. The _q8
// variant also writes the output's int8 codes for the GGUF int8 kernel of the down projection (q8_activation.cuh);
// the interleaved variant reads a projection whose gate and up features alternate in groups of 8 (the layout the
// skinny GEMM's fused SiLU epilogue needs its weight in, seen by the prefill path). With a deferred norm
// (deferred_norm.h) each CTA first computes its token's 1/rms and scales gate and up by it.
#include "cuda/activation.h"
#include "cuda/common.cuh"
#include "cuda/deferred_norm.cuh"
#include "cuda/q8_activation.cuh"

namespace candle_vllm::cuda {
namespace {

// G: 0, or the scale group (32 or 256 values, q8_activation.cuh) of the int8 codes the kernel also writes.
template <typename T, int V, int G, bool kInter = false, bool kNorm = false>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* x, int8_t* __restrict__ xq,
                                    gguf::XBlock* __restrict__ xb, int d,
                                    const DeferredNorm norm) {  // x: not the read-only path (PDL)
  using Vt = Vec<T, V>;
  pdl_launch_dependents();
  const size_t t = blockIdx.y;
  // The deferred norm's scale first, while the GEMM before still runs (deferred_norm.h).
  const bool norm_early = kNorm && norm.before_wait;
  float scale = norm_early ? block_inv_rms<T>(norm, static_cast<int64_t>(t)) : 1.f;
  pdl_wait();
  const int nvec = d / V, stride = gridDim.x * blockDim.x;
  const Vt* gate = reinterpret_cast<const Vt*>(x + t * 2 * d);
  const Vt* up = reinterpret_cast<const Vt*>(x + t * 2 * d + d);
  Vt* o = reinterpret_cast<Vt*>(out + t * d);
  // Interleaved (V == 8): output vector i = gate vector 2i, up vector 2i + 1 of the row. Each trip's inputs are
  // loaded a trip ahead.
  Vt a, b;
  auto load = [&](int i) {
    if (i < nvec) a = kInter ? gate[2 * i] : gate[i], b = kInter ? gate[2 * i + 1] : up[i];
  };
  load(blockIdx.x * blockDim.x + threadIdx.x);
  if (kNorm && !norm_early) scale = block_inv_rms<T>(norm, static_cast<int64_t>(t));
  // Every thread of a CTA takes the same number of trips (the code blocks' shuffles need the whole warp).
  for (int base = blockIdx.x * blockDim.x; base < nvec; base += stride) {
    const int i = base + threadIdx.x;
    const bool live = i < nvec;
    Vt r;
    if (live) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        r.v[j] = from_f32<T>(silu_mul(to_f32(a.v[j]) * scale, to_f32(b.v[j]) * scale));
      }
      o[i] = r;
    }
    load(i + stride);
    if constexpr (G != 0) q8_store_vec<G>(r, live, xq, xb, t * d + static_cast<size_t>(i) * V);
  }
}

void launch(void* out, const void* x, int8_t* xq, void* xb, int group, int64_t tokens, int64_t d, bool interleaved,
            DType dtype, std::uintptr_t stream, const DeferredNorm& norm = {}) {
  const char* what = xq ? "silu_and_mul_q8" : interleaved ? "silu_and_mul_interleaved" : "silu_and_mul";
  if (tokens == 0 || d == 0) return;
  if (tokens > 65535) throw std::invalid_argument(std::string(what) + ": at most 65535 tokens per call");
  dispatch_float<true>(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    auto go = [&](auto kernel, int64_t nvec) {
      const int threads = 256;
      const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(64, (nvec + threads - 1) / threads)));
      launch_pdl(what, kernel, dim3(blocks, static_cast<unsigned>(tokens)), dim3(threads), 0, as_stream(stream),
                 static_cast<T*>(out), static_cast<const T*>(x), xq, static_cast<gguf::XBlock*>(xb),
                 static_cast<int>(d), for_launch(norm));
    };
    const bool vec = d % kVec == 0 && aligned16(out, x);
    if (interleaved) {
      if constexpr (kVec == 8) {
        if (!vec) throw std::invalid_argument(std::string(what) + ": needs d % 8 == 0 and 16-byte aligned x, out");
        check_deferred_norm(what, norm, sizeof(T));
        if (norm.rows != nullptr) go(silu_and_mul_kernel<T, kVec, 0, true, true>, d / kVec);
        else go(silu_and_mul_kernel<T, kVec, 0, true>, d / kVec);
        return;
      }
      throw std::invalid_argument(std::string(what) + ": f16/bf16 only");
    }
    if (xq != nullptr) {
      if constexpr (sizeof(T) == 2) {
        if (!vec || (group != 32 && group != 256) || d % group != 0 || !aligned16(xq) ||
            reinterpret_cast<std::uintptr_t>(xb) % 8 != 0)
          throw std::invalid_argument(std::string(what) + ": needs a scale group of 32 or 256 values dividing d, "
                                      "16-byte aligned x, out and xq, 8-byte aligned xb");
        dispatch_q8_group(group, [&](auto g) { go(silu_and_mul_kernel<T, kVec, g>, d / kVec); });
        return;
      }
      throw std::invalid_argument(std::string(what) + ": int8 codes are written for f16/bf16 rows only");
    }
    if (vec) go(silu_and_mul_kernel<T, kVec, 0>, d / kVec);
    else go(silu_and_mul_kernel<T, 1, 0>, d);
  });
}

}  // namespace

void silu_and_mul(void* out, const void* x, int64_t tokens, int64_t d, DType dtype, std::uintptr_t stream) {
  launch(out, x, nullptr, nullptr, 0, tokens, d, false, dtype, stream);
}

void silu_and_mul_interleaved(void* out, const void* x, int64_t tokens, int64_t d, DType dtype,
                              std::uintptr_t stream, const DeferredNorm& norm) {
  launch(out, x, nullptr, nullptr, 0, tokens, d, true, dtype, stream, norm);
}

void silu_and_mul_q8(void* out, int8_t* xq, void* xb, int group, const void* x, int64_t tokens, int64_t d,
                     DType dtype, std::uintptr_t stream) {
  launch(out, x, xq, xb, group, tokens, d, false, dtype, stream);
}

}  // namespace candle_vllm::cuda
