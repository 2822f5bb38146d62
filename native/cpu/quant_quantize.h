// In-situ quantization (ISQ) of dense weights into GGUF blocks on the CPU.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"
#include "cpu/quant_blocks.h"

namespace candle_vllm::cpu {

// Encode x [rows, cols] (f32, f16 or bf16, row-major) as `rows` rows of GGUF blocks of type `t` into `out`
// (rows * row_bytes); cols must be a whole number of blocks. Rows are spread over the OpenMP threads.
void quantize_rows(const void* x, DType x_dtype, int64_t rows, int64_t cols, QType t, uint8_t* out);

}  // namespace candle_vllm::cpu
