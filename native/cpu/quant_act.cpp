#include "cpu/quant_act.h"

#include <cmath>
#include <stdexcept>

#include "cpu/dtype_io.h"

namespace candle_vllm::cpu {
namespace {

// Symmetric 8-bit quantization of n values with one scale; codes stay in [-127, 127] so the kernels may
// negate them (the sign trick for signed x signed products) without overflow. Returns the scale.
template <int N>
float quantize_group(const float* v, int8_t* q) {
  float amax = 0.f;
  for (int i = 0; i < N; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  const float d = amax / 127.f;
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < N; ++i) {
    const float s = v[i] * id;
    q[i] = static_cast<int8_t>(static_cast<int>(s + (s >= 0.f ? 0.5f : -0.5f)));
  }
  return d;
}

template <typename IO, int N>
void load_group(const typename IO::storage* x, float* v) {
  for (int i = 0; i < N; ++i) v[i] = IO::load(x[i]);
}

template <typename IO>
void q8x32_rows(const typename IO::storage* x, int64_t rows, int64_t k, BlockQ8x32* out) {
  const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (rows * k >= (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    float v[QK];
    for (int64_t b = 0; b < nb; ++b) {
      BlockQ8x32& blk = out[r * nb + b];
      load_group<IO, QK>(x + r * k + b * QK, v);
      blk.d = quantize_group<QK>(v, blk.qs);
      int sum = 0;
      for (int i = 0; i < QK; ++i) sum += blk.qs[i];
      blk.s = blk.d * static_cast<float>(sum);
    }
  }
}

template <typename IO>
void q8xk_rows(const typename IO::storage* x, int64_t rows, int64_t k, BlockQ8xK* out) {
  const int64_t nb = k / QKK;
#pragma omp parallel for schedule(static) if (rows * k >= (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    float v[QKK];
    for (int64_t b = 0; b < nb; ++b) {
      BlockQ8xK& blk = out[r * nb + b];
      load_group<IO, QKK>(x + r * k + b * QKK, v);
      blk.d = quantize_group<QKK>(v, blk.qs);
      for (int g = 0; g < QKK / 16; ++g) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += blk.qs[16 * g + i];
        blk.bsums[g] = static_cast<int16_t>(sum);
      }
    }
  }
}

template <typename IO>
void f32_rows(const typename IO::storage* x, int64_t rows, int64_t k, float* out) {
#pragma omp parallel for schedule(static) if (rows * k >= (1 << 15))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) out[r * k + i] = IO::load(x[r * k + i]);
}

}  // namespace

#define CANDLE_VLLM_ACT_DISPATCH(fn, ...)                                                     \
  switch (dtype) {                                                                            \
    case DType::F32: return fn<F32>(static_cast<const float*>(x), __VA_ARGS__);               \
    case DType::F16: return fn<F16>(static_cast<const uint16_t*>(x), __VA_ARGS__);            \
    case DType::BF16: return fn<BF16>(static_cast<const uint16_t*>(x), __VA_ARGS__);          \
    default: throw std::invalid_argument("quantized matmul: activations must be f32, f16 or bf16"); \
  }

void quantize_act_q8x32(const void* x, DType dtype, int64_t rows, int64_t k, BlockQ8x32* out) {
  CANDLE_VLLM_ACT_DISPATCH(q8x32_rows, rows, k, out)
}

void quantize_act_q8xk(const void* x, DType dtype, int64_t rows, int64_t k, BlockQ8xK* out) {
  CANDLE_VLLM_ACT_DISPATCH(q8xk_rows, rows, k, out)
}

void act_to_f32(const void* x, DType dtype, int64_t rows, int64_t k, float* out) {
  CANDLE_VLLM_ACT_DISPATCH(f32_rows, rows, k, out)
}

#undef CANDLE_VLLM_ACT_DISPATCH

}  // namespace candle_vllm::cpu
