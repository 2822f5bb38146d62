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

// rms_norm / fused_add_rms_norm that also write their output's int8 codes for the GGUF int8 kernels: xq [rows,
// hidden] int8 and xb one 8-byte block per 32 values (native/cuda/q8_activation.cuh), one scale per group of 32
// or 256 values (the group the consuming kernel takes), the same bytes that kernel's own quantizer writes for that
// output. f16/bf16, hidden % group == 0, every tensor and xq 16-byte aligned, xb 8-byte aligned.
void rms_norm_q8(void* out, int8_t* xq, void* xb, int group, const void* x, const void* weight, int64_t rows,
                 int64_t hidden, float eps, DType dtype, std::uintptr_t stream);
void fused_add_rms_norm_q8(void* x, void* residual, int8_t* xq, void* xb, int group, const void* weight,
                           int64_t rows, int64_t hidden, float eps, DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
