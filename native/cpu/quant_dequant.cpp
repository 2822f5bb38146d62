#include "cpu/quant_dequant.h"

#include <stdexcept>
#include <vector>

#include "cpu/quant_simd.h"

namespace candle_vllm::cpu {
namespace {

inline float h(uint16_t v) { return f16_to_f32(v); }

// The 32-element types unpack their codes into bytes first, then scale: both loops vectorise.
inline void nibble_codes(const uint8_t* qs, uint8_t* q) {
  for (int j = 0; j < QK / 2; ++j) {
    q[j] = qs[j] & 0x0F;
    q[j + QK / 2] = qs[j] >> 4;
  }
}

inline void add_high_bits(const uint8_t* qh_bytes, uint8_t* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < QK; ++j) q[j] |= static_cast<uint8_t>(((qh >> j) & 1) << 4);
}

inline void scale_codes(const uint8_t* q, float d, float offset_codes, float* y) {  // y = d * (q - offset)
  for (int j = 0; j < QK; ++j) y[j] = d * (static_cast<float>(q[j]) - offset_codes);
}

inline void affine_codes(const uint8_t* q, float d, float m, float* y) {  // y = d * q + m
  for (int j = 0; j < QK; ++j) y[j] = d * static_cast<float>(q[j]) + m;
}

void deq(const BlockQ4_0& b, float* y) {
  uint8_t q[QK];
  nibble_codes(b.qs, q);
  scale_codes(q, h(b.d), 8.f, y);
}

void deq(const BlockQ4_1& b, float* y) {
  uint8_t q[QK];
  nibble_codes(b.qs, q);
  affine_codes(q, h(b.d), h(b.m), y);
}

void deq(const BlockQ5_0& b, float* y) {
  uint8_t q[QK];
  nibble_codes(b.qs, q);
  add_high_bits(b.qh, q);
  scale_codes(q, h(b.d), 16.f, y);
}

void deq(const BlockQ5_1& b, float* y) {
  uint8_t q[QK];
  nibble_codes(b.qs, q);
  add_high_bits(b.qh, q);
  affine_codes(q, h(b.d), h(b.m), y);
}

void deq(const BlockQ8_0& b, float* y) {
  const float d = h(b.d);
  for (int j = 0; j < QK; ++j) y[j] = d * static_cast<float>(b.qs[j]);
}

// K types: sub-block scales first, then vectorisable loops over each sub-block's elements. Element
// 128*half + 32*shift + l of Q2_K/Q3_K reads bit-plane `shift` of byte 32*half + l (16-element groups g).
void deq(const BlockQ2_K& b, float* y) {
  const float d = h(b.d), dmin = h(b.dmin);
  for (int g = 0; g < 16; ++g) {
    const float dl = d * static_cast<float>(b.scales[g] & 0x0F), ml = dmin * static_cast<float>(b.scales[g] >> 4);
    const uint8_t* q = b.qs + 32 * (g / 8) + 16 * (g % 2);
    const int shift = 2 * ((g % 8) / 2);
    for (int l = 0; l < 16; ++l) y[16 * g + l] = dl * static_cast<float>((q[l] >> shift) & 3) - ml;
  }
}

void deq(const BlockQ3_K& b, float* y) {
  const float d = h(b.d);
  int8_t sc[16];
  q3k_scales(b.scales, sc);
  for (int g = 0; g < 16; ++g) {
    const float dl = d * static_cast<float>(sc[g]);
    const int half = g / 8, shift = (g % 8) / 2, l0 = 16 * (g % 2);
    const uint8_t* q = b.qs + 32 * half + l0;
    const uint8_t* hm = b.hmask + l0;
    for (int l = 0; l < 16; ++l) {
      const int low = (q[l] >> (2 * shift)) & 3;
      const int high = (hm[l] >> (4 * half + shift)) & 1;
      y[16 * g + l] = dl * static_cast<float>(low - (high ? 0 : 4));
    }
  }
}

// Q4_K/Q5_K: 32 bytes at 32*(sub/2) hold sub-blocks 2k (low nibbles) and 2k+1 (high nibbles).
void deq(const BlockQ4_K& b, float* y) {
  const float d = h(b.d), dmin = h(b.dmin);
  for (int sub = 0; sub < 8; ++sub) {
    uint8_t sc, m;
    k4_scale_min(b.scales, sub, sc, m);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
    const uint8_t* q = b.qs + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
    for (int l = 0; l < 32; ++l) y[32 * sub + l] = dl * static_cast<float>((q[l] >> shift) & 0x0F) - ml;
  }
}

void deq(const BlockQ5_K& b, float* y) {
  const float d = h(b.d), dmin = h(b.dmin);
  for (int sub = 0; sub < 8; ++sub) {
    uint8_t sc, m;
    k4_scale_min(b.scales, sub, sc, m);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
    const uint8_t* q = b.qs + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
    for (int l = 0; l < 32; ++l) {
      const int code = ((q[l] >> shift) & 0x0F) | (((b.qh[l] >> sub) & 1) << 4);
      y[32 * sub + l] = dl * static_cast<float>(code) - ml;
    }
  }
}

// Q6_K: element 128*half + kk takes nibble kk/64 of ql[64*half + kk%64] and bit pair kk/32 of qh[32*half + kk%32].
void deq(const BlockQ6_K& b, float* y) {
  const float d = h(b.d);
  for (int g = 0; g < 16; ++g) {
    const float dl = d * static_cast<float>(b.scales[g]);
    const int half = g / 8, kk0 = 16 * (g % 8);
    const uint8_t* ql = b.ql + 64 * half + kk0 % 64;
    const uint8_t* qh = b.qh + 32 * half + kk0 % 32;
    const int lo_shift = 4 * (kk0 / 64), hi_shift = 2 * (kk0 / 32);
    for (int l = 0; l < 16; ++l) {
      const int code = ((ql[l] >> lo_shift) & 0x0F) | (((qh[l] >> hi_shift) & 3) << 4);
      y[16 * g + l] = dl * static_cast<float>(code - 32);
    }
  }
}

#if CANDLE_VLLM_AVX2
// weight = fma(d, code, offset): d * code is exact, so this rounds once, like gguf's d * (code - 8) and d * code + m.
template <class Ops>
void deq_row_affine32(const uint8_t* row, float* out, int64_t n) {
  const auto* blocks = reinterpret_cast<const typename Ops::Block*>(row);
  for (int64_t b = 0; b < n / QK; ++b) {
    const __m256i q = Ops::codes(blocks[b]);
    const float d = h(blocks[b].d);
    const __m256 dv = _mm256_set1_ps(d), ov = _mm256_set1_ps(Ops::offset(blocks[b], d));
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
      const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      _mm256_storeu_ps(out + b * QK + 8 * i, _mm256_fmadd_ps(dv, codes, ov));
    }
  }
}
#endif

template <typename Block, int N>
void deq_row(const uint8_t* row, float* out, int64_t n) {
  const auto* blocks = reinterpret_cast<const Block*>(row);
  for (int64_t b = 0; b < n / N; ++b) deq(blocks[b], out + b * N);
}

// f32 -> f16 / bf16 rows (round to nearest even, as the scalar converters in half.h), 8 lanes at a time.
void store_f16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if CANDLE_VLLM_AVX2
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

void store_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if CANDLE_VLLM_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
#endif
  for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

}  // namespace

void dequantize_row_portable(QType t, const uint8_t* row, float* out, int64_t n) {
  switch (t) {
    case QType::F32: std::memcpy(out, row, n * sizeof(float)); return;
    case QType::F16: {
      const auto* src = reinterpret_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(src[i]);
      return;
    }
    case QType::BF16: {
      const auto* src = reinterpret_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(src[i]);
      return;
    }
    case QType::Q4_0: return deq_row<BlockQ4_0, QK>(row, out, n);
    case QType::Q4_1: return deq_row<BlockQ4_1, QK>(row, out, n);
    case QType::Q5_0: return deq_row<BlockQ5_0, QK>(row, out, n);
    case QType::Q5_1: return deq_row<BlockQ5_1, QK>(row, out, n);
    case QType::Q8_0: return deq_row<BlockQ8_0, QK>(row, out, n);
    case QType::Q2_K: return deq_row<BlockQ2_K, QKK>(row, out, n);
    case QType::Q3_K: return deq_row<BlockQ3_K, QKK>(row, out, n);
    case QType::Q4_K: return deq_row<BlockQ4_K, QKK>(row, out, n);
    case QType::Q5_K: return deq_row<BlockQ5_K, QKK>(row, out, n);
    case QType::Q6_K: return deq_row<BlockQ6_K, QKK>(row, out, n);
  }
  throw std::invalid_argument("dequantize: unsupported type");
}

void dequantize_row(QType t, const uint8_t* row, float* out, int64_t n) {
#if CANDLE_VLLM_AVX2
  switch (t) {
    case QType::F16: {
      const auto* src = reinterpret_cast<const uint16_t*>(row);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(avx2::load128(src + i)));
      for (; i < n; ++i) out[i] = f16_to_f32(src[i]);
      return;
    }
    case QType::BF16: {
      const auto* src = reinterpret_cast<const uint16_t*>(row);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(avx2::load128(src + i)), 16)));
      for (; i < n; ++i) out[i] = bf16_to_f32(src[i]);
      return;
    }
    case QType::Q4_0: return deq_row_affine32<avx2::Q4_0Ops>(row, out, n);
    case QType::Q4_1: return deq_row_affine32<avx2::Q4_1Ops>(row, out, n);
    case QType::Q5_0: return deq_row_affine32<avx2::Q5_0Ops>(row, out, n);
    case QType::Q5_1: return deq_row_affine32<avx2::Q5_1Ops>(row, out, n);
    default: break;
  }
#endif
  dequantize_row_portable(t, row, out, n);
}

void dequantize(const uint8_t* data, QType t, int64_t rows, int64_t cols, void* out, DType out_dtype) {
  const QTypeInfo info = qtype_info(t);
  if (cols % info.block != 0) throw std::invalid_argument("dequantize: row length is not a multiple of the block size");
  if (out_dtype != DType::F32 && out_dtype != DType::F16 && out_dtype != DType::BF16)
    throw std::invalid_argument("dequantize: output dtype must be f32, f16 or bf16");
  const int64_t row_bytes = cols / info.block * info.bytes;
  const int64_t out_elem = out_dtype == DType::F32 ? 4 : 2;
#pragma omp parallel if (rows * cols >= (1 << 16))
  {
    std::vector<float> tmp(out_dtype == DType::F32 ? 0 : cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      void* dst = static_cast<uint8_t*>(out) + r * cols * out_elem;
      if (out_dtype == DType::F32) {
        dequantize_row(t, data + r * row_bytes, static_cast<float*>(dst), cols);
        continue;
      }
      dequantize_row(t, data + r * row_bytes, tmp.data(), cols);
      if (out_dtype == DType::F16) store_f16(tmp.data(), static_cast<uint16_t*>(dst), cols);
      else store_bf16(tmp.data(), static_cast<uint16_t*>(dst), cols);
    }
  }
}

}  // namespace candle_vllm::cpu
