// RMSNorm kernels on CPU: rows of `hidden` elements, normalised in f32 and scaled by a weight vector.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cpu {

// out[r] = x[r] / rms(x[r]) * weight; all buffers share `dtype`.
void rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden, float eps, DType dtype);

// In place, vLLM's fused form: residual[r] += x[r]; x[r] = rms_norm(residual[r]) * weight.
void fused_add_rms_norm(void* x, void* residual, const void* weight, int64_t rows, int64_t hidden, float eps,
                        DType dtype);

// One row, on the calling thread only (for callers that split finer units across threads themselves).
void rms_norm_row(void* out, const void* x, const void* weight, int64_t hidden, float eps, DType dtype);

// The same two kernels as shares of an enclosing OpenMP parallel region (rows split across its threads, no
// barrier at the end), for the fused decoder layer; alone outside a region they do every row.
void rms_norm_share(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden, float eps,
                    DType dtype);
void fused_add_rms_norm_share(void* x, void* residual, const void* weight, int64_t rows, int64_t hidden, float eps,
                              DType dtype);

}  // namespace candle_vllm::cpu
