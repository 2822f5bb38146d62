// The TurboQuant rows' encoder, shared by the kernels that write them (turbo_kv.cu's cache write, turbo_rope.cu's
// RoPE + write): a warp holds one head vector, E = D / 32 consecutive channels a lane (turbo_rows.cuh), and stores
// it as codes plus an f32 absmax; each encoder can also leave in x the values its row decodes to (K turned back),
// which turbo_kv.cu's blocks-to-dense kernel also gives.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/fp8_kv.cuh"
#include "cuda/turbo_rows.cuh"

namespace candle_vllm::cuda::turbo {

// Absmax codes of the warp's vector: code = rint(clamp(x / a * half + half, 0, 2 half)); returns a.
template <int E>
__device__ __forceinline__ float absmax_codes(const float (&x)[E], float half, int (&code)[E]) {
  float a = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) a = fmaxf(a, fabsf(x[e]));
  a = warp_max(a);
  const float safe = a > 0.f ? a : 1.f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float pre = __fadd_rn(__fmul_rn(__fdiv_rn(x[e], safe), half), half);
    code[e] = __float2int_rn(fminf(fmaxf(pre, 0.f), 2.f * half));
  }
  return a;
}

template <int E>
__device__ __forceinline__ void store_nibbles(uint8_t* dst, const int (&code)[E]) {
  uint8_t bytes[E / 2];
#pragma unroll
  for (int b = 0; b < E / 2; ++b) bytes[b] = static_cast<uint8_t>(code[2 * b] | (code[2 * b + 1] << 4));
  store_run(dst + (threadIdx.x & 31) * (E / 2), bytes);
}

// Eight 3-bit codes in three bytes, channel i of the eight at bits 3i..3i+2: the 8 / E lanes of a group OR their
// shifted bits together, and the group's first lane stores them.
template <int E>
__device__ __forceinline__ void store_triples(uint8_t* dst, const int (&code)[E]) {
  constexpr int kLanes = 8 / E;
  const int lane = threadIdx.x & 31;
  uint32_t bits = 0;
#pragma unroll
  for (int e = 0; e < E; ++e) bits |= static_cast<uint32_t>(code[e]) << (3 * e);
  bits <<= 3 * E * (lane % kLanes);
#pragma unroll
  for (int m = 1; m < kLanes; m *= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, m);
  if (lane % kLanes == 0) {
    uint8_t* p = dst + 3 * (lane / kLanes);
    p[0] = bits & 0xff;
    p[1] = (bits >> 8) & 0xff;
    p[2] = (bits >> 16) & 0xff;
  }
}

// (code - half) * (a / half), the reference's dequantization.
template <int E>
__device__ __forceinline__ void dequant(float (&x)[E], const int (&code)[E], float a, float half) {
  const float step = __fdiv_rn(a, half);
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = __fmul_rn(__fsub_rn(static_cast<float>(code[e]), half), step);
}

template <typename T, int E>
__device__ __forceinline__ void store_lane(T* dst, const float (&x)[E]) {
  T out[E];
#pragma unroll
  for (int e = 0; e < E; ++e) out[e] = from_f32<T>(x[e]);
  store_run(dst + (threadIdx.x & 31) * E, out);
}

// K codes back to the unrotated key: dequantized, then signs * H k' / sqrt_d (H is its own inverse up to D).
template <int E>
__device__ __forceinline__ void unrotated_k(float (&x)[E], const int (&code)[E], float a, float half,
                                            const float* signs, float sqrt_d) {
  const int lane = threadIdx.x & 31;
  dequant(x, code, a, half);
  hadamard(x);
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = __fdiv_rn(x[e], sqrt_d) * signs[lane * E + e];
}

// Stores the warp's key vector x as the K half of `row`: e4m3 (k_bits 8), or rotated and coded (4 / 3 bits).
// With back, x then holds what the row decodes to, K turned back.
template <int E>
__device__ __forceinline__ void encode_k(float (&x)[E], uint8_t* row, const RowLayout& L, int k_bits,
                                         const float* signs, float sqrt_d, bool back) {
  const int lane = threadIdx.x & 31;
  if (k_bits == 8) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const Fp8 f = to_e4m3(x[e]);
      reinterpret_cast<Fp8*>(row)[lane * E + e] = f;
      x[e] = static_cast<float>(f);
    }
    return;
  }
  int code[E];
  rotate(x, signs, sqrt_d);
  const float half = k_bits == 4 ? 7.5f : 3.f;
  const float a = absmax_codes(x, half, code);
  if (k_bits == 4) store_nibbles(row, code);
  else store_triples(row, code);
  if (lane == 0) store_f32(row + L.k_code_bytes, a);
  if (back) unrotated_k(x, code, a, half, signs, sqrt_d);
}

// Stores the warp's value vector x as the V half of `row` (4-bit codes); with back, x then holds what it decodes to.
template <int E>
__device__ __forceinline__ void encode_v(float (&x)[E], uint8_t* row, const RowLayout& L, bool back) {
  const int lane = threadIdx.x & 31;
  int code[E];
  const float a = absmax_codes(x, 7.5f, code);
  store_nibbles(row + L.k_bytes, code);
  if (lane == 0) store_f32(row + L.k_bytes + 16 * E, a);  // after the D / 2 code bytes
  if (back) dequant(x, code, a, 7.5f);
}

}  // namespace candle_vllm::cuda::turbo
