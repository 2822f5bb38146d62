#include "cpu/norm.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/dtype_io.h"

namespace candle_vllm::cpu {
namespace {

// Checked before a parallel region: an exception must not escape one.
void check_float(DType dtype, const char* what) {
  if (dtype != DType::F32 && dtype != DType::F16 && dtype != DType::BF16)
    throw std::invalid_argument(std::string(what) + ": dtype must be f32, f16 or bf16");
}

template <typename IO>
void rms_norm_one(typename IO::storage* outr, const typename IO::storage* xr, const typename IO::storage* w,
                  int64_t hidden, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = IO::load(xr[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) outr[i] = IO::store(IO::load(xr[i]) * inv * IO::load(w[i]));
}

template <typename IO>
void rms_norm_impl(typename IO::storage* out, const typename IO::storage* x, const typename IO::storage* w,
                   int64_t rows, int64_t hidden, float eps) {
#pragma omp for schedule(static) nowait
  for (int64_t r = 0; r < rows; ++r) rms_norm_one<IO>(out + r * hidden, x + r * hidden, w, hidden, eps);
}

template <typename IO>
void fused_add_rms_norm_impl(typename IO::storage* x, typename IO::storage* res, const typename IO::storage* w,
                             int64_t rows, int64_t hidden, float eps) {
#pragma omp for schedule(static) nowait
  for (int64_t r = 0; r < rows; ++r) {
    auto* xr = x + r * hidden;
    auto* rr = res + r * hidden;
    float sum = 0.f;
    for (int64_t i = 0; i < hidden; ++i) {
      // The residual is stored in the model dtype, and the norm reads the stored (rounded) value, as torch does.
      rr[i] = IO::store(IO::load(xr[i]) + IO::load(rr[i]));
      const float v = IO::load(rr[i]);
      sum += v * v;
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i) xr[i] = IO::store(IO::load(rr[i]) * inv * IO::load(w[i]));
  }
}

}  // namespace

void rms_norm_row(void* out, const void* x, const void* weight, int64_t hidden, float eps, DType dtype) {
  switch (dtype) {
    case DType::F32: return rms_norm_one<F32>(static_cast<float*>(out), static_cast<const float*>(x), static_cast<const float*>(weight), hidden, eps);
    case DType::F16: return rms_norm_one<F16>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(weight), hidden, eps);
    case DType::BF16: return rms_norm_one<BF16>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(weight), hidden, eps);
    default: throw std::invalid_argument("rms_norm: dtype must be f32, f16 or bf16");
  }
}

void rms_norm_share(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden, float eps,
                    DType dtype) {
  switch (dtype) {
    case DType::F32: return rms_norm_impl<F32>(static_cast<float*>(out), static_cast<const float*>(x), static_cast<const float*>(weight), rows, hidden, eps);
    case DType::F16: return rms_norm_impl<F16>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(weight), rows, hidden, eps);
    case DType::BF16: return rms_norm_impl<BF16>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(weight), rows, hidden, eps);
    default: throw std::invalid_argument("rms_norm: dtype must be f32, f16 or bf16");
  }
}

void fused_add_rms_norm_share(void* x, void* residual, const void* weight, int64_t rows, int64_t hidden, float eps,
                              DType dtype) {
  switch (dtype) {
    case DType::F32: return fused_add_rms_norm_impl<F32>(static_cast<float*>(x), static_cast<float*>(residual), static_cast<const float*>(weight), rows, hidden, eps);
    case DType::F16: return fused_add_rms_norm_impl<F16>(static_cast<uint16_t*>(x), static_cast<uint16_t*>(residual), static_cast<const uint16_t*>(weight), rows, hidden, eps);
    case DType::BF16: return fused_add_rms_norm_impl<BF16>(static_cast<uint16_t*>(x), static_cast<uint16_t*>(residual), static_cast<const uint16_t*>(weight), rows, hidden, eps);
    default: throw std::invalid_argument("fused_add_rms_norm: dtype must be f32, f16 or bf16");
  }
}

void rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden, float eps, DType dtype) {
  check_float(dtype, "rms_norm");
#pragma omp parallel if (rows > 1)
  rms_norm_share(out, x, weight, rows, hidden, eps, dtype);
}

void fused_add_rms_norm(void* x, void* residual, const void* weight, int64_t rows, int64_t hidden, float eps,
                        DType dtype) {
  check_float(dtype, "fused_add_rms_norm");
#pragma omp parallel if (rows > 1)
  fused_add_rms_norm_share(x, residual, weight, rows, hidden, eps, dtype);
}

}  // namespace candle_vllm::cpu
