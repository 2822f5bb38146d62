// GGUF (ggml) block basics shared by the CUDA decoders (gguf_decode.cuh) and the dp4a Parts (gguf_q8.cuh): the
// type codes, GGUF_HD (host + device), exact f32 arithmetic, unaligned little-endian loads and f16 scales.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define GGUF_HD __host__ __device__ __forceinline__
#else
#define GGUF_HD inline
#endif

namespace candle_vllm::gguf {

// gguf's GGMLQuantizationType values.
enum QType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int kUnitElems = 256;

// ---- exact f32 helpers (no FMA contraction, even under --use_fast_math) --------------------------------------

GGUF_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GGUF_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GGUF_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

GGUF_HD uint32_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
// A 32-bit word at a 2-byte aligned address.
GGUF_HD uint32_t ld32(const uint8_t* p) { return ld16(p) | (ld16(p + 2) << 16); }

GGUF_HD float f16(const uint8_t* p) {
  const uint32_t h = ld16(p);
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&v, &bits, 4);
  return v;
#endif
}

// Bytes k and k+1 of v moved to bytes 0 and 2 (the two halves of a packed pair).
GGUF_HD uint32_t spread(uint32_t v, int k) {
#ifdef __CUDA_ARCH__
  return __byte_perm(v, 0, k == 0 ? 0x4140 : 0x4342);
#else
  return ((v >> (8 * k)) & 0xFF) | (((v >> (8 * k + 8)) & 0xFF) << 16);
#endif
}

constexpr uint32_t kLo4 = 0x000F000F, kLo2 = 0x00030003, kLo1 = 0x00010001;

// A type's decoder (gguf_decode_block32.cuh, gguf_decode_kquants.cuh; the contract is in gguf_decode.cuh).
template <int Q>
struct Deq;

}  // namespace candle_vllm::gguf
