// Decode GEMM for up to 64 tokens on Hopper's warpgroup tensor cores (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

constexpr int kWideMaxM = 64;

// Whether `device` runs wide_gemm: a Hopper GPU and a module built with sm_90a (the kernel uses wgmma).
bool wide_gemm_available(int device);

// y[M, N] = x[M, K] @ W[N, K]^T, 1 <= M <= 64, f16/bf16, contiguous and 16-byte aligned, K % 8 == 0. CTAs own
// 64 weight rows; splits > 1 cuts K into that many parts, whose f32 sums go through partials (splits*M*N) and
// counters (int32, ceil(N/64), zero before and after) as in skinny_gemm. silu_mul: W is a gate/up projection
// interleaved in groups of 8 rows (N % 16 == 0) and y [M, N/2] = silu(gate) * up, rounded as the projection
// followed by silu_and_mul rounds it.
void wide_gemm(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M, int64_t N, int64_t K,
               int splits, bool silu_mul, DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
