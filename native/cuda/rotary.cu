// RoPE in place on q and k: one CTA per token, threads over (head, pair). cos/sin are rounded to the
// activations' dtype before use, as transformers (and ops/rotary.py's reference) does; the rotation itself is
// done in f32 and rounded once.
#include "cuda/common.cuh"
#include "cuda/rotary.h"

namespace candle_vllm::cuda {
namespace {

template <typename T>
__device__ __forceinline__ void rotate_heads(T* base, int heads, int head_dim, int half, const float* cs,
                                             bool is_neox) {
  for (int e = threadIdx.x; e < heads * half; e += blockDim.x) {
    const int h = e / half, i = e % half;
    T* head = base + static_cast<size_t>(h) * head_dim;
    const int i1 = is_neox ? i : 2 * i, i2 = is_neox ? i + half : 2 * i + 1;
    const float c = round_to<T>(cs[i]), s = round_to<T>(cs[half + i]);
    const float x1 = to_f32(head[i1]), x2 = to_f32(head[i2]);
    head[i1] = from_f32<T>(x1 * c - x2 * s);
    head[i2] = from_f32<T>(x2 * c + x1 * s);
  }
}

template <typename T>
__global__ void rotary_kernel(T* __restrict__ q, T* __restrict__ k, const int64_t* __restrict__ positions,
                              const float* __restrict__ cos_sin, int q_heads, int k_heads, int head_dim,
                              int rotary_dim, int64_t q_stride, int64_t k_stride, bool is_neox) {
  const int64_t t = blockIdx.x;
  const float* cs = cos_sin + positions[t] * rotary_dim;
  const int half = rotary_dim / 2;
  rotate_heads(q + t * q_stride, q_heads, head_dim, half, cs, is_neox);
  rotate_heads(k + t * k_stride, k_heads, head_dim, half, cs, is_neox);
}

}  // namespace

void rotary_embedding(void* q, void* k, const int64_t* positions, const float* cos_sin, int64_t tokens,
                      int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                      int64_t k_stride, bool is_neox, DType dtype, std::uintptr_t stream) {
  if (rotary_dim % 2 != 0 || rotary_dim > head_dim)
    throw std::invalid_argument("rotary_embedding: rotary_dim must be even and <= head_dim");
  if (tokens == 0) return;
  dispatch_float<true>(dtype, "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    const int64_t pairs = std::max(q_heads, k_heads) * rotary_dim / 2;
    const int threads = static_cast<int>(std::min<int64_t>(512, ((pairs + 31) / 32) * 32));
    rotary_kernel<T><<<static_cast<unsigned>(tokens), threads, 0, as_stream(stream)>>>(
        static_cast<T*>(q), static_cast<T*>(k), positions, cos_sin, static_cast<int>(q_heads),
        static_cast<int>(k_heads), static_cast<int>(head_dim), static_cast<int>(rotary_dim), q_stride, k_stride,
        is_neox);
  });
  check_launch("rotary_embedding");
}

}  // namespace candle_vllm::cuda
