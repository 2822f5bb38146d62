// AVX2 helpers shared by the quantized dot products and the dequantizer: unpacking GGUF block codes into
// byte vectors, and the 32-element block types described as weight = d * code + offset.
#pragma once
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CANDLE_VLLM_AVX2 1
#include <immintrin.h>

#include <cstring>

#include "cpu/quant_blocks.h"

namespace candle_vllm::cpu::avx2 {

inline float h(uint16_t v) { return f16_to_f32(v); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// 16 bytes of packed nibbles -> 32 codes: the low nibbles (elements 0..15), then the high nibbles (16..31).
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i v = load128(qs);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// Byte i = `value` where bit i of `bits` is set, else 0.
inline __m256i bits_to_bytes(uint32_t bits, char value) {
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(value));
}

// Bit plane `shift` of each byte, moved to bit position `to`.
inline __m256i bit_plane(__m256i v, int shift, int to) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(1)), to);
}

// ---- 32-element types: weight = d * code + offset, code unsigned (d * code is exact in f32) ----

struct Q4_0Ops {
  using Block = BlockQ4_0;
  static __m256i codes(const Block& b) { return nibbles(b.qs); }
  static float offset(const Block&, float d) { return -8.f * d; }
};
struct Q4_1Ops {
  using Block = BlockQ4_1;
  static __m256i codes(const Block& b) { return nibbles(b.qs); }
  static float offset(const Block& b, float) { return h(b.m); }
};
inline uint32_t qh32(const uint8_t* qh) {
  uint32_t v;
  std::memcpy(&v, qh, 4);
  return v;
}
struct Q5_0Ops {
  using Block = BlockQ5_0;
  static __m256i codes(const Block& b) { return _mm256_or_si256(nibbles(b.qs), bits_to_bytes(qh32(b.qh), 0x10)); }
  static float offset(const Block&, float d) { return -16.f * d; }
};
struct Q5_1Ops {
  using Block = BlockQ5_1;
  static __m256i codes(const Block& b) { return _mm256_or_si256(nibbles(b.qs), bits_to_bytes(qh32(b.qh), 0x10)); }
  static float offset(const Block& b, float) { return h(b.m); }
};

}  // namespace candle_vllm::cpu::avx2

#endif
