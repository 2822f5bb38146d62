// GGUF (ggml) block layouts of the quantized weight types, and the 8-bit activation blocks the integer dot
// products pair them with. Field order and sizes follow ggml's on-disk format (ggml-common.h); the numeric
// type codes are gguf's GGMLQuantizationType values so Python can pass `qtype.value` straight through.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/half.h"

namespace candle_vllm::cpu {

enum class QType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

constexpr int QK = 32;    // elements per block of the "legacy" types
constexpr int QKK = 256;  // elements per super-block of the K types

struct BlockQ4_0 { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[QK / 2]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[QK]; };
struct BlockQ2_K { uint8_t scales[QKK / 16]; uint8_t qs[QKK / 4]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[QKK / 8]; uint8_t qs[QKK / 4]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QKK / 2]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QKK / 8]; uint8_t qs[QKK / 2]; };
struct BlockQ6_K { uint8_t ql[QKK / 2]; uint8_t qh[QKK / 4]; int8_t scales[QKK / 16]; uint16_t d; };

static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_0) == 34 && sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);

// Activations quantized per 32 values: x ~= d * qs, s = d * sum(qs) (the sum serves the offset/min terms of
// Q4_0/Q4_1/Q5_0/Q5_1). Scales stay f32 (ggml rounds them to f16) since this buffer never leaves the call.
struct BlockQ8x32 { float d; float s; int8_t qs[QK]; };
// Activations quantized per 256 values for the K types; bsums holds the sums of each 16 consecutive qs.
struct BlockQ8xK { float d; int16_t bsums[QKK / 16]; int8_t qs[QKK]; };

struct QTypeInfo {
  int block;  // elements per block
  int bytes;  // bytes per block
};

inline QTypeInfo qtype_info(QType t) {
  switch (t) {
    case QType::F32: return {1, 4};
    case QType::F16: return {1, 2};
    case QType::BF16: return {1, 2};
    case QType::Q4_0: return {QK, sizeof(BlockQ4_0)};
    case QType::Q4_1: return {QK, sizeof(BlockQ4_1)};
    case QType::Q5_0: return {QK, sizeof(BlockQ5_0)};
    case QType::Q5_1: return {QK, sizeof(BlockQ5_1)};
    case QType::Q8_0: return {QK, sizeof(BlockQ8_0)};
    case QType::Q2_K: return {QKK, sizeof(BlockQ2_K)};
    case QType::Q3_K: return {QKK, sizeof(BlockQ3_K)};
    case QType::Q4_K: return {QKK, sizeof(BlockQ4_K)};
    case QType::Q5_K: return {QKK, sizeof(BlockQ5_K)};
    case QType::Q6_K: return {QKK, sizeof(BlockQ6_K)};
  }
  throw std::invalid_argument("unsupported GGML quantization type " + std::to_string(static_cast<int>(t)));
}

inline QType to_qtype(int code) {
  const auto t = static_cast<QType>(code);
  qtype_info(t);  // throws for codes without kernels
  return t;
}

// The 6-bit scale and min of sub-block j (0..7) packed in Q4_K/Q5_K's 12 scale bytes.
inline void k4_scale_min(const uint8_t* q, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The 16 signed 6-bit scales (already minus 32) packed in Q3_K's 12 scale bytes.
inline void q3k_scales(const uint8_t* q, int8_t out[16]) {
  for (int k = 0; k < 16; ++k) {
    const int lo = k < 8 ? (q[k] & 0x0F) : (q[k - 8] >> 4);
    const int hi = (q[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
    out[k] = static_cast<int8_t>((lo | (hi << 4)) - 32);
  }
}

}  // namespace candle_vllm::cpu
