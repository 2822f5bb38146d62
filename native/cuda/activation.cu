// SiLU-and-mul (SwiGLU) over the fused gate/up projection: one read of each input, one write, f32 maths.
#include "cuda/activation.h"
#include "cuda/common.cuh"

namespace candle_vllm::cuda {
namespace {

template <typename T, int V>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* x, int d) {  // x: not the read-only path (PDL)
  using Vt = Vec<T, V>;
  pdl_wait();
  const size_t t = blockIdx.y;
  const Vt* gate = reinterpret_cast<const Vt*>(x + t * 2 * d);
  const Vt* up = reinterpret_cast<const Vt*>(x + t * 2 * d + d);
  Vt* o = reinterpret_cast<Vt*>(out + t * d);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d / V; i += gridDim.x * blockDim.x) {
    const Vt a = gate[i], b = up[i];
    Vt r;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = to_f32(a.v[j]);
      r.v[j] = from_f32<T>(g / (1.f + __expf(-g)) * to_f32(b.v[j]));
    }
    o[i] = r;
  }
  pdl_launch_dependents();
}

}  // namespace

void silu_and_mul(void* out, const void* x, int64_t tokens, int64_t d, DType dtype, std::uintptr_t stream) {
  if (tokens == 0 || d == 0) return;
  if (tokens > 65535) throw std::invalid_argument("silu_and_mul: at most 65535 tokens per call");
  dispatch_float<true>(dtype, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    auto go = [&](auto kernel, int64_t nvec) {
      const int threads = 256;
      const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(64, (nvec + threads - 1) / threads)));
      launch_pdl("silu_and_mul", kernel, dim3(blocks, static_cast<unsigned>(tokens)), dim3(threads), 0,
                 as_stream(stream), static_cast<T*>(out), static_cast<const T*>(x), static_cast<int>(d));
    };
    if (d % kVec == 0 && aligned16(out, x)) go(silu_and_mul_kernel<T, kVec>, d / kVec);
    else go(silu_and_mul_kernel<T, 1>, d);
  });
}

}  // namespace candle_vllm::cuda
