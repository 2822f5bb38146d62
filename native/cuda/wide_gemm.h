// Decode GEMM for 17..64 tokens on Hopper (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

constexpr int kWideMaxM = 64;
constexpr int kWideRows = 256;  // weight rows per CTA

// Whether `device` runs wide_gemm: a Hopper GPU and a module built with sm_90a (the kernel uses TMA and wgmma).
bool wide_gemm_available(int device);

// y[M, N] = x[M, K] @ W[N, K]^T, 1 <= M <= 64, f16/bf16, contiguous and 16-byte aligned, K % 8 == 0. One CTA per
// kWideRows weight rows, alone on its SM. silu_mul: W is a gate/up projection interleaved in groups of 8 rows
// (N % 16 == 0) and y [M, N/2] = silu(gate) * up, rounded as the projection followed by silu_and_mul rounds it.
void wide_gemm(void* y, const void* x, const void* w, int64_t M, int64_t N, int64_t K, bool silu_mul, DType dtype,
               std::uintptr_t stream);

}  // namespace candle_vllm::cuda
