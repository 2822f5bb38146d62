// RMSNorm on CUDA (declared in plain C++ for the bindings); same semantics as native/cpu/norm.h.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

// out[r] = round(x[r] / rms(x[r])) * weight, rows of `hidden` contiguous elements; f32, f16 or bf16.
void rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden, float eps, DType dtype,
              std::uintptr_t stream);

// In place: residual[r] += x[r] (stored in dtype); x[r] = rms_norm(residual[r]) * weight.
void fused_add_rms_norm(void* x, void* residual, const void* weight, int64_t rows, int64_t hidden, float eps,
                        DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
