// Gated activation on CUDA (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

// out[t, :d] = silu(x[t, :d]) * x[t, d:2d]; x [tokens, 2d] and out [tokens, d] contiguous; f32, f16 or bf16.
void silu_and_mul(void* out, const void* x, int64_t tokens, int64_t d, DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
