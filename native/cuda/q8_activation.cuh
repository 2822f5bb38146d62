// Int8 activations for the GGUF int8 kernels (the dp4a GEMV, the tensor-core product): the block format and the one
// quantization rule every producer uses.
//
// Each row of x is cut into 32-value blocks, each stored as 32 int8 codes (row-major, [rows, K], element e of a
// row at byte e) plus an XBlock (at e / 32): the f32 scale d = amax / 127 and the integer sums of the codes of
// its two 16-value halves. Codes are round(v * (127 / amax)) with ties away from zero, every float operation
// IEEE-rounded (__fdiv_rn/__fmul_rn/__fadd_rn, so no contraction into an FMA can change a code).
//
// amax is taken over a group of G values: G = 32 (each block its own scale), or G = 256 (the 8 blocks of a
// 256-value run share one scale, each XBlock carrying the same d: Q8_K's rule, which the CPU path and llama.cpp's
// CPU kernels use for the K-quants). Both read the same way; G = 256 lets the tensor-core product of a K-quant
// weight keep a whole 256-element unit's sums in integers (gguf_mmq.cu).
//
// Producers: the GEMV's own quantizer (gguf_gemv_q8.cu) and the RMSNorm / SiLU-and-mul kernels that write codes
// next to their f16/bf16 output (norm.cu, activation.cu). All of them call q8_store_block on the values as
// stored (already rounded to the storage type), so they write the same bytes whatever their thread mapping: max
// and integer sums do not depend on the order of reduction, and the per-value operations are the same.
#pragma once
#include <cstdint>

namespace candle_vllm::gguf {

struct XBlock {
  float d;
  int16_t sum[2];  // sums of the int8 codes of elements 0..15 and 16..31
};
static_assert(sizeof(XBlock) == 8, "XBlock is read as one 8-byte load");

}  // namespace candle_vllm::gguf

#ifdef __CUDACC__
#include <type_traits>

#include "cuda/common.cuh"

namespace candle_vllm::cuda {

__device__ __forceinline__ float q8_inv_scale(float amax) { return amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f; }

__device__ __forceinline__ int q8_code(float v, float inv) {
  const float s = __fmul_rn(v, inv);
  return static_cast<int>(truncf(__fadd_rn(s, s >= 0.f ? 0.5f : -0.5f)));
}

// Quantizes one 32-value block held by a group of 32 / N consecutive threads, the group starting at a thread
// index that is a multiple of its size; thread g of the group holds values N*g .. N*g+N-1 in v. With G = 256 the
// scale is shared by the G / N consecutive threads holding a 256-value run (N = 8: a whole warp, all live or all
// dead). Uses shuffles over the full warp: every thread of the warp must call it the same number of times (dead
// threads with live = false and any v). Live threads store their N codes at xq (N-byte aligned), the block's first
// thread the XBlock at xb.
template <int N, int G = 32>
__device__ __forceinline__ void q8_store_block(const float (&v)[N], bool live, int8_t* xq, gguf::XBlock* xb) {
  static_assert(N == 4 || N == 8, "4 or 8 values per thread");
  static_assert(G == 32 || (G == 256 && N == 8), "a 256-value scale group is one warp of 8 values per thread");
  constexpr int kLanes = 32 / N, kHalfLanes = kLanes / 2, kGroupLanes = G / N;
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int o = 1; o < kGroupLanes; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float inv = q8_inv_scale(amax);
  uint32_t words[N / 4] = {};
  int sum = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int q = q8_code(v[j], inv);
    sum += q;
    words[j / 4] |= (static_cast<uint32_t>(q) & 0xFF) << (8 * (j % 4));
  }
#pragma unroll
  for (int o = 1; o < kHalfLanes; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const int upper = __shfl_down_sync(0xffffffffu, sum, kHalfLanes);  // the second half's sum, at its first lanes
  if (!live) return;
  if constexpr (N == 4) *reinterpret_cast<uint32_t*>(xq) = words[0];
  else *reinterpret_cast<uint2*>(xq) = make_uint2(words[0], words[1]);
  if ((threadIdx.x & (kLanes - 1)) == 0) {
    gguf::XBlock b;
    b.d = __fdiv_rn(amax, 127.f);
    b.sum[0] = static_cast<int16_t>(sum);
    b.sum[1] = static_cast<int16_t>(upper);
    *xb = b;
  }
}

// q8_store_block on a vector of stored values whose first is element e of the [rows, K] activations (rows
// contiguous); v is ignored where !live.
template <int G, typename T, int N>
__device__ __forceinline__ void q8_store_vec(const Vec<T, N>& v, bool live, int8_t* xq, gguf::XBlock* xb, size_t e) {
  float f[N];
#pragma unroll
  for (int j = 0; j < N; ++j) f[j] = live ? to_f32(v.v[j]) : 0.f;
  q8_store_block<N, G>(f, live, xq + e, xb + e / 32);
}

// Calls f(std::integral_constant<int, G>) for a runtime scale group of 32 or 256 values; false for any other.
template <typename F>
bool dispatch_q8_group(int group, F&& f) {
  if (group == 32) f(std::integral_constant<int, 32>{});
  else if (group == 256) f(std::integral_constant<int, 256>{});
  else return false;
  return true;
}

}  // namespace candle_vllm::cuda
#endif  // __CUDACC__
