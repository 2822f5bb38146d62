// Gated activation on CUDA (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"
#include "cuda/deferred_norm.h"

namespace candle_vllm::cuda {

// out[t, :d] = silu(x[t, :d]) * x[t, d:2d]; x [tokens, 2d] and out [tokens, d] contiguous; f32, f16 or bf16.
void silu_and_mul(void* out, const void* x, int64_t tokens, int64_t d, DType dtype, std::uintptr_t stream);

// silu_and_mul over x whose gate and up features alternate in groups of 8 (x[t, 16j .. 16j+7] = gate 8j .. 8j+7,
// x[t, 16j+8 .. 16j+15] = up 8j .. 8j+7): f16/bf16, d % 8 == 0, x and out 16-byte aligned. With norm.rows set,
// gate and up are first scaled by token t's 1/rms of those rows (deferred_norm.h).
void silu_and_mul_interleaved(void* out, const void* x, int64_t tokens, int64_t d, DType dtype,
                              std::uintptr_t stream, const DeferredNorm& norm = {});

// silu_and_mul that also writes out's int8 codes for the GGUF int8 kernels: xq [tokens, d] int8 and xb one 8-byte
// block per 32 values (native/cuda/q8_activation.cuh), one scale per group of 32 or 256 values (the group the
// consuming kernel takes), the same bytes that kernel's own quantizer writes for out. f16/bf16, d % group == 0,
// x, out and xq 16-byte aligned, xb 8-byte aligned.
void silu_and_mul_q8(void* out, int8_t* xq, void* xb, int group, const void* x, int64_t tokens, int64_t d,
                     DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
