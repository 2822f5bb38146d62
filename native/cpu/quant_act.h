// Activation rows quantized to 8-bit blocks, so the matmul kernels can take integer dot products with the
// weight blocks (as llama.cpp does) instead of dequantizing weights to floats.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"
#include "cpu/quant_blocks.h"

namespace candle_vllm::cpu {

// x: [rows, k] contiguous in `dtype` (f32/f16/bf16), k a multiple of 32 -> out: [rows, k/32] blocks.
void quantize_act_q8x32(const void* x, DType dtype, int64_t rows, int64_t k, BlockQ8x32* out);

// x: [rows, k] contiguous in `dtype`, k a multiple of 256 -> out: [rows, k/256] blocks.
void quantize_act_q8xk(const void* x, DType dtype, int64_t rows, int64_t k, BlockQ8xK* out);

// x: [rows, k] in `dtype` -> out: [rows, k] f32 (for float weights and the portable path).
void act_to_f32(const void* x, DType dtype, int64_t rows, int64_t k, float* out);

}  // namespace candle_vllm::cpu
