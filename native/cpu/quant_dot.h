// Dot products of a few quantized weight rows with a few activation rows: the inner kernels of the quantized
// matmul. Each weight type has an AVX2 kernel working on 8-bit activation blocks (integer products as in
// llama.cpp) and a portable kernel (dequantize the row, f32 dot) used where AVX2 is unavailable.
#pragma once
#include <cstdint>

#include "cpu/quant_blocks.h"

namespace candle_vllm::cpu {

// Activation rows a kernel expects: f32, or quantized to BlockQ8x32 / BlockQ8xK blocks.
enum class ActKind { F32, Q8x32, Q8xK };

// Most activation rows and weight rows one kernel call handles (each weight block is decoded once per call).
constexpr int kDotRows = 4;
constexpr int kDotWeightRows = 4;

// out[r * arows + j] = dot(weight row r, activation row j) for r < wrows (1..kDotWeightRows) and
// j < arows (1..kDotRows). Weight rows start at `w`, `row_bytes` apart; activation rows start at `act`,
// `act_stride` bytes apart; `k` is the row length in elements.
using DotFn = void (*)(const uint8_t* w, int64_t row_bytes, int wrows, const void* act, int64_t act_stride,
                       int64_t k, int arows, float* out);

struct DotKernel {
  ActKind act;
  DotFn fn;
};

// The kernel for `t`: the AVX2 one when built for AVX2 and `portable` is false, else the portable one.
DotKernel dot_kernel(QType t, bool portable);

// The AVX2 kernel for `t` (defined in quant_dot_avx2.cpp); {F32, nullptr} when not built for AVX2.
DotKernel dot_kernel_avx2(QType t);

// Name of the instruction set the non-portable kernels use ("avx2" or "portable").
const char* dot_kernel_isa();

}  // namespace candle_vllm::cpu
