// The ISQ CPU driver: rows to f32, then the per-block quantizers shared with the CUDA kernel.
// Multiply-add contraction is off for this file (x86-64-v3 has FMA and GCC fuses by default in GNU mode), so the
// blocks match llama.cpp's reference quantizers and the CUDA kernel bit for bit.
#pragma GCC optimize("fp-contract=off")
#include "cpu/quant_quantize.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/half.h"
#include "cpu/quant_quantize_impl.h"

namespace candle_vllm::cpu {
namespace {

using BlockFn = void (*)(const float*, uint8_t*);

BlockFn block_quantizer(QType t) {
  switch (t) {
    case QType::Q4_0: return isq::quantize_q4_0;
    case QType::Q4_1: return isq::quantize_q4_1;
    case QType::Q5_0: return isq::quantize_q5_0;
    case QType::Q5_1: return isq::quantize_q5_1;
    case QType::Q8_0: return isq::quantize_q8_0;
    case QType::Q2_K: return isq::quantize_q2_k;
    case QType::Q3_K: return isq::quantize_q3_k;
    case QType::Q4_K: return isq::quantize_q4_k;
    case QType::Q5_K: return isq::quantize_q5_k;
    case QType::Q6_K: return isq::quantize_q6_k;
    default: break;
  }
  throw std::invalid_argument("no ISQ quantizer for GGML type " + std::to_string(static_cast<int>(t)));
}

void row_to_f32(const void* x, DType dt, int64_t row, int64_t cols, float* out) {
  const int64_t base = row * cols;
  switch (dt) {
    case DType::F32: {
      const float* p = static_cast<const float*>(x) + base;
      for (int64_t i = 0; i < cols; ++i) out[i] = p[i];
      return;
    }
    case DType::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(x) + base;
      for (int64_t i = 0; i < cols; ++i) out[i] = f16_to_f32(p[i]);
      return;
    }
    case DType::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(x) + base;
      for (int64_t i = 0; i < cols; ++i) out[i] = bf16_to_f32(p[i]);
      return;
    }
    default: throw std::invalid_argument("ISQ input must be f32, f16 or bf16");
  }
}

}  // namespace

void quantize_rows(const void* x, DType x_dtype, int64_t rows, int64_t cols, QType t, uint8_t* out) {
  const BlockFn fn = block_quantizer(t);
  const QTypeInfo info = qtype_info(t);
  if (cols % info.block) {
    throw std::invalid_argument("ISQ rows of " + std::to_string(cols) + " elements are not whole blocks of " +
                                std::to_string(info.block));
  }
  if (x_dtype != DType::F32 && x_dtype != DType::F16 && x_dtype != DType::BF16) {
    throw std::invalid_argument("ISQ input must be f32, f16 or bf16");
  }
  const int64_t blocks = cols / info.block, row_bytes = blocks * info.bytes;
#pragma omp parallel
  {
    std::vector<float> buf(static_cast<size_t>(cols));
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; ++r) {
      row_to_f32(x, x_dtype, r, cols, buf.data());
      uint8_t* dst = out + r * row_bytes;
      for (int64_t b = 0; b < blocks; ++b) fn(buf.data() + b * info.block, dst + b * info.bytes);
    }
  }
}

}  // namespace candle_vllm::cpu
