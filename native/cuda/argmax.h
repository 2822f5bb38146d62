// Greedy sampling on device: argmax over the vocabulary per row (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

// out[r] = index of the largest logits[r, :] (first one on ties, NaN counts as largest, like torch.argmax);
// logits [rows, vocab] contiguous f32/f16/bf16, out int64 [rows].
void argmax_rows(int64_t* out, const void* logits, int64_t rows, int64_t vocab, DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
