// Dequantization of GGUF weight blocks to floats: the building block of the dequantize op and of the portable
// (non-AVX2) matmul path.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"
#include "cpu/quant_blocks.h"

namespace candle_vllm::cpu {

// Decode one row of `n` elements (a whole number of blocks of `t`) starting at `row` into f32.
void dequantize_row(QType t, const uint8_t* row, float* out, int64_t n);

// The same with plain C++ only: what dequantize_row falls back to without AVX2, and what the portable matmul
// kernels use (so testing them on an AVX2 machine covers this code too).
void dequantize_row_portable(QType t, const uint8_t* row, float* out, int64_t n);

// Decode a [rows, cols] tensor stored as consecutive rows of blocks into `out` (f32, f16 or bf16).
void dequantize(const uint8_t* data, QType t, int64_t rows, int64_t cols, void* out, DType out_dtype);

}  // namespace candle_vllm::cpu
