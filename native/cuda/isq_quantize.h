// In-situ quantization on the GPU (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

// out [rows, row_bytes] = GGUF blocks of type `qtype` (a GGMLQuantizationType value) for x [rows, cols]
// (contiguous f32/f16/bf16 on the device), byte-equal to the CPU quantizer; enqueued on `stream`.
void isq_quantize(uint8_t* out, const void* x, int64_t rows, int64_t cols, DType dtype, int qtype,
                  std::uintptr_t stream);

}  // namespace candle_vllm::cuda
