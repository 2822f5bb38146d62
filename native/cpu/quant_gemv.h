// y = x @ W.T with W stored as GGUF blocks: the CPU decode hot path. Each weight row is read from memory once
// per call and dotted against all activation rows while it sits in L1; output rows are split across OpenMP
// threads.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"
#include "cpu/quant_blocks.h"

namespace candle_vllm::cpu {

// x: [m, k] contiguous (f32/f16/bf16), w: [n, k/block * bytes] blocks of `t`, y: [m, n] in x's dtype.
// `portable` forces the portable kernels (tests use it to check them on AVX2 machines).
void quant_matmul(const void* x, DType dtype, const uint8_t* w, QType t, int64_t m, int64_t n, int64_t k, void* y,
                  bool portable);

}  // namespace candle_vllm::cpu
