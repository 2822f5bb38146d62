#include "cpu/quant_dot.h"

#include <stdexcept>
#include <vector>

#include "cpu/quant_dequant.h"

namespace candle_vllm::cpu {
namespace {

// Dequantize each weight row once, then f32 dot products with each activation row.
template <QType T>
void dot_portable(const uint8_t* w, int64_t row_bytes, int wrows, const void* act, int64_t act_stride, int64_t k,
                  int arows, float* out) {
  thread_local std::vector<float> wf;
  wf.resize(static_cast<size_t>(k));
  for (int r = 0; r < wrows; ++r) {
    dequantize_row_portable(T, w + r * row_bytes, wf.data(), k);
    for (int j = 0; j < arows; ++j) {
      const auto* x = reinterpret_cast<const float*>(static_cast<const uint8_t*>(act) + j * act_stride);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < k; ++i) sum += wf[i] * x[i];
      out[r * arows + j] = sum;
    }
  }
}

DotKernel portable_kernel(QType t) {
  switch (t) {
    case QType::F32: return {ActKind::F32, dot_portable<QType::F32>};
    case QType::F16: return {ActKind::F32, dot_portable<QType::F16>};
    case QType::BF16: return {ActKind::F32, dot_portable<QType::BF16>};
    case QType::Q4_0: return {ActKind::F32, dot_portable<QType::Q4_0>};
    case QType::Q4_1: return {ActKind::F32, dot_portable<QType::Q4_1>};
    case QType::Q5_0: return {ActKind::F32, dot_portable<QType::Q5_0>};
    case QType::Q5_1: return {ActKind::F32, dot_portable<QType::Q5_1>};
    case QType::Q8_0: return {ActKind::F32, dot_portable<QType::Q8_0>};
    case QType::Q2_K: return {ActKind::F32, dot_portable<QType::Q2_K>};
    case QType::Q3_K: return {ActKind::F32, dot_portable<QType::Q3_K>};
    case QType::Q4_K: return {ActKind::F32, dot_portable<QType::Q4_K>};
    case QType::Q5_K: return {ActKind::F32, dot_portable<QType::Q5_K>};
    case QType::Q6_K: return {ActKind::F32, dot_portable<QType::Q6_K>};
  }
  throw std::invalid_argument("quantized matmul: unsupported type");
}

}  // namespace

DotKernel dot_kernel(QType t, bool portable) {
  if (!portable) {
    const DotKernel k = dot_kernel_avx2(t);
    if (k.fn != nullptr) return k;
  }
  return portable_kernel(t);
}

}  // namespace candle_vllm::cpu
