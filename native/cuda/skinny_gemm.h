// Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 64 (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

constexpr int kSkinnyMaxM = 64;
constexpr int kSkinnyNarrowMaxM = 16;  // up to here one CTA covers 16 weight rows (skinny_gemm.cu)
constexpr int kSkinnyWideRows = 64;    // above, one CTA covers 64 weight rows (skinny_gemm_wide.cu)
constexpr int kSkinnyRowsPerTile = 16;
constexpr int kSkinnyChunkK = 128;

// x, w, y share `dtype` (f16 or bf16); contiguous, 16-byte aligned, K % 8 == 0, 1 <= M <= 64.
// With splits > 1, the K range is cut into `splits` parts: partials (f32, splits*M*N) hold their sums and
// counters (int32, ceil(N/16), all zero before the call; left zero after it) elect the CTA that adds them up.
void skinny_gemm(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M, int64_t N,
                 int64_t K, int splits, DType dtype, std::uintptr_t stream);

// The 17 <= M <= 64 half of skinny_gemm (same contract); grid (ceil(N/64), splits), splits non-empty.
void skinny_gemm_wide(void* y, const void* x, const void* w, float* partials, int* counters, int M, int N, int K,
                      int splits, int chunks_per_split, DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
