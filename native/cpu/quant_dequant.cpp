#include "cpu/quant_dequant.h"

#include <stdexcept>
#include <vector>

#include "cpu/dtype_io.h"

namespace candle_vllm::cpu {
namespace {

inline float h(uint16_t v) { return f16_to_f32(v); }

void deq(const BlockQ4_0& b, float* y) {
  const float d = h(b.d);
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = d * static_cast<float>((b.qs[j] & 0x0F) - 8);
    y[j + QK / 2] = d * static_cast<float>((b.qs[j] >> 4) - 8);
  }
}

void deq(const BlockQ4_1& b, float* y) {
  const float d = h(b.d), m = h(b.m);
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = d * static_cast<float>(b.qs[j] & 0x0F) + m;
    y[j + QK / 2] = d * static_cast<float>(b.qs[j] >> 4) + m;
  }
}

inline uint32_t load_qh(const uint8_t* qh) {
  uint32_t v;
  std::memcpy(&v, qh, 4);
  return v;
}

void deq(const BlockQ5_0& b, float* y) {
  const float d = h(b.d);
  const uint32_t qh = load_qh(b.qh);
  for (int j = 0; j < QK / 2; ++j) {
    const int lo = (b.qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    const int hi = (b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo - 16);
    y[j + QK / 2] = d * static_cast<float>(hi - 16);
  }
}

void deq(const BlockQ5_1& b, float* y) {
  const float d = h(b.d), m = h(b.m);
  const uint32_t qh = load_qh(b.qh);
  for (int j = 0; j < QK / 2; ++j) {
    const int lo = (b.qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    const int hi = (b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo) + m;
    y[j + QK / 2] = d * static_cast<float>(hi) + m;
  }
}

void deq(const BlockQ8_0& b, float* y) {
  const float d = h(b.d);
  for (int j = 0; j < QK; ++j) y[j] = d * static_cast<float>(b.qs[j]);
}

// K types: element i = 128*half + 32*shift + l reads bit-plane `shift` of byte 32*half + l.
void deq(const BlockQ2_K& b, float* y) {
  const float d = h(b.d), dmin = h(b.dmin);
  for (int i = 0; i < QKK; ++i) {
    const int half = i / 128, shift = (i / 32) % 4, l = i % 32, k = i / 16;
    const int q = (b.qs[32 * half + l] >> (2 * shift)) & 3;
    y[i] = d * static_cast<float>(b.scales[k] & 0x0F) * static_cast<float>(q) -
           dmin * static_cast<float>(b.scales[k] >> 4);
  }
}

void deq(const BlockQ3_K& b, float* y) {
  const float d = h(b.d);
  int8_t sc[16];
  q3k_scales(b.scales, sc);
  for (int i = 0; i < QKK; ++i) {
    const int half = i / 128, shift = (i / 32) % 4, l = i % 32;
    const int low = (b.qs[32 * half + l] >> (2 * shift)) & 3;
    const int high = (b.hmask[l] >> (4 * half + shift)) & 1;
    y[i] = d * static_cast<float>(sc[i / 16]) * static_cast<float>(low - (high ? 0 : 4));
  }
}

void deq(const BlockQ4_K& b, float* y) {
  const float d = h(b.d), dmin = h(b.dmin);
  for (int i = 0; i < QKK; ++i) {
    const int sub = i / 32;  // byte 32*(sub/2) + l holds sub-blocks 2k (low nibble) and 2k+1 (high nibble)
    uint8_t sc, m;
    k4_scale_min(b.scales, sub, sc, m);
    const int q = (b.qs[32 * (sub / 2) + i % 32] >> (4 * (sub % 2))) & 0x0F;
    y[i] = d * static_cast<float>(sc) * static_cast<float>(q) - dmin * static_cast<float>(m);
  }
}

void deq(const BlockQ5_K& b, float* y) {
  const float d = h(b.d), dmin = h(b.dmin);
  for (int i = 0; i < QKK; ++i) {
    const int sub = i / 32, l = i % 32;
    uint8_t sc, m;
    k4_scale_min(b.scales, sub, sc, m);
    const int q = ((b.qs[32 * (sub / 2) + l] >> (4 * (sub % 2))) & 0x0F) | (((b.qh[l] >> sub) & 1) << 4);
    y[i] = d * static_cast<float>(sc) * static_cast<float>(q) - dmin * static_cast<float>(m);
  }
}

void deq(const BlockQ6_K& b, float* y) {
  const float d = h(b.d);
  for (int i = 0; i < QKK; ++i) {
    const int half = i / 128, k = i % 128;  // k / 32 selects the nibble of ql and the bit pair of qh
    const int lo = (b.ql[64 * half + k % 64] >> (4 * (k / 64))) & 0x0F;
    const int hi = (b.qh[32 * half + k % 32] >> (2 * (k / 32))) & 3;
    y[i] = d * static_cast<float>(b.scales[i / 16]) * static_cast<float>((lo | (hi << 4)) - 32);
  }
}

template <typename Block, int N>
void deq_row(const uint8_t* row, float* out, int64_t n) {
  const auto* blocks = reinterpret_cast<const Block*>(row);
  for (int64_t b = 0; b < n / N; ++b) deq(blocks[b], out + b * N);
}

template <typename IO>
void store_row(const float* src, void* dst, int64_t n) {
  auto* out = static_cast<typename IO::storage*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = IO::store(src[i]);
}

}  // namespace

void dequantize_row(QType t, const uint8_t* row, float* out, int64_t n) {
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
      if (out_dtype == DType::F16) store_row<F16>(tmp.data(), dst, cols);
      else store_row<BF16>(tmp.data(), dst, cols);
    }
  }
}

}  // namespace candle_vllm::cpu
