// The e4m3 KV cache (--kvcache-dtype fp8): how the cache writes store a value and how the attention kernels turn
// cached bytes into f16 mma operands without a conversion pass through shared memory.
//
// Stores saturate to +-448 and round to nearest even (a value past the range keeps its sign at the largest finite
// magnitude, never NaN); there is no per-tensor scale (1.0, as vLLM's default without calibrated scales).
// Reads: e4m3 converts exactly to f16 (cvt.rn.f16x2.e4m3x2 on sm_89+, two values an instruction; sm_80 builds get
// cuda_fp8.h's software conversion, correct but slower), so the kernels run Q K^T and P V as f16 mma with f32 accumulation whatever the activation dtype; q and P are rounded to f16.
// Fragments come straight from ldmatrix on the e4m3 tile, each 16-byte chunk (16 values of one row) read as
// eight b16 "elements" of value pairs:
// - K (non-transposed): lane (g, t) receives bytes 4t..4t+3 of row g: the B fragment of a k-step whose 16
//   channels are the chunk's, in the order b0 = channels 4t, 4t+1 and b1 = 4t+2, 4t+3. Q's A fragment must use
//   the same order: logical k index i of a step stands for channel 4 (i / 2) + i % 2 when i < 8, else
//   4 ((i - 8) / 2) + 2 + i % 2.
// - V (transposed): lane (g, t) receives channels 2g, 2g+1 of rows 2t and 2t+1; one byte permute gives the B
//   fragments of two 8-wide n-tiles, channel 2g (even tile) and 2g+1 (odd tile). Output column n of the n-tile
//   (chunk c, parity p) is channel 16c + 2n + p.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"

namespace candle_vllm::cuda {

using Fp8 = __nv_fp8_e4m3;  // the cache element type of an e4m3 cache

// The stored value of x (saturating, round to nearest even).
__device__ __forceinline__ Fp8 to_e4m3(float x) {
  Fp8 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return r;
}

// N values as a cache of element KV stores them: as they are (KV = T), or as to_e4m3.
template <typename KV, typename T, int N>
__device__ __forceinline__ Vec<KV, N> to_cache(const Vec<T, N>& x) {
  if constexpr (std::is_same_v<KV, T>) {
    return x;
  } else {
    Vec<KV, N> r;
#pragma unroll
    for (int i = 0; i < N; ++i) r.v[i] = to_e4m3(to_f32(x.v[i]));
    return r;
  }
}

// Element idx of a cache half a fused epilogue writes one value at a time: v as it is, or as to_e4m3.
template <typename T>
__device__ __forceinline__ void store_cache_value(void* cache, int64_t idx, T v, bool e4m3) {
  if (e4m3) {
    static_cast<Fp8*>(cache)[idx] = to_e4m3(to_f32(v));
  } else {
    static_cast<T*>(cache)[idx] = v;
  }
}

// Two e4m3 values (the low 16 bits of w, low byte first) as an f16x2 word, the low byte's value in the low half.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// Two values of T (a 32-bit word of f16 or bf16, the low one first) as an f16x2 word: q's operand words beside an
// e4m3 cache.
template <typename T>
__device__ __forceinline__ uint32_t to_f16x2(uint32_t w) {
  if constexpr (std::is_same_v<T, __half>) {
    return w;
  } else {
    const __half2 h = __floats2half2_rn(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// K: one ldmatrix word (channels 4t..4t+3 of a chunk) -> the k-step's B fragment pair.
__device__ __forceinline__ void e4m3_k_frag(uint32_t w, uint32_t& b0, uint32_t& b1) {
  b0 = e4m3x2_to_f16x2(w);
  b1 = e4m3x2_to_f16x2(w >> 16);
}

// V: one ldmatrix .trans word {row 2t: ch 2g, 2g+1; row 2t+1: ch 2g, 2g+1} -> the B registers of the even-channel
// and odd-channel n-tiles for these two rows.
__device__ __forceinline__ void e4m3_v_frag(uint32_t w, uint32_t& even, uint32_t& odd) {
  const uint32_t p = __byte_perm(w, 0u, 0x3120u);
  even = e4m3x2_to_f16x2(p);
  odd = e4m3x2_to_f16x2(p >> 16);
}

}  // namespace candle_vllm::cuda
