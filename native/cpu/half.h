// IEEE half and bfloat16 <-> float conversions for CPU kernels (F16C is used when the target has it).
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <algorithm>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace candle_vllm::cpu {

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t f32_to_f16(float f) {  // round to nearest even
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  auto to_bits = [](float v) { uint32_t b; std::memcpy(&b, &v, 4); return b; };
  auto from_bits = [](uint32_t b) { float v; std::memcpy(&v, &b, 4); return v; };
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;  // rounds the mantissa, flushes overflow to inf
  const uint32_t w = to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
#endif
}

// e4m3, the KV cache of --kvcache-dtype fp8: a sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
// 0x7f / 0xff NaN. Every value is exact in f32.
inline float e4m3_to_f32(uint8_t b) {
  const int exp = (b >> 3) & 0xf, man = b & 7;
  float v;
  if (exp == 15 && man == 7) v = std::numeric_limits<float>::quiet_NaN();
  else if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);
  else v = std::ldexp(static_cast<float>(8 + man), exp - 10);
  return (b & 0x80) ? -v : v;
}

// Round to nearest even, saturating at +-448 (as the CUDA cache writes store, and torch's cast of the clamped
// value); NaN stays NaN.
inline uint8_t f32_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const int sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= 448.f) return static_cast<uint8_t>(sign | 0x7e);
  if (a == 0.f) return static_cast<uint8_t>(sign);
  int e2 = 0;
  std::frexp(a, &e2);                      // a = m 2^e2, m in [0.5, 1)
  const int e = std::max(e2 - 1, -6);      // a's binade; subnormals share 2^-6's step
  int q = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - e)));  // a in steps of 2^(e - 3): 0 .. 16
  if (e == -6 && q < 8) return static_cast<uint8_t>(sign | q);     // subnormal
  int field = e + 7;
  if (q == 16) q = 8, ++field;  // rounded up into the next binade (never past 448: a < 448)
  return static_cast<uint8_t>(sign | (field << 3) | (q - 8));
}

}  // namespace candle_vllm::cpu
