// Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 16 (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

constexpr int kSkinnyMaxM = 16;
constexpr int kSkinnyRowsPerTile = 16;
constexpr int kSkinnyChunkK = 128;
constexpr int kSkinnyAddNormMaxM = 8;  // the tail runs in the one-token-group kernel

// x, w, y share `dtype` (f16 or bf16); contiguous, 16-byte aligned, K % 8 == 0, 1 <= M <= 16.
// With splits > 1, the K range is cut into `splits` parts: partials (f32, splits*M*N) hold their sums and
// counters (int32, ceil(N/16), all zero before the call; left zero after it) elect the CTA that adds them up.
// `warps` (4 or 8) is the CTA size: the warps of a tile's CTA interleave over its K chunks, so 8 keep twice the
// weight bytes in flight per tile where there are too few tiles for several CTAs per SM.
void skinny_gemm(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M, int64_t N,
                 int64_t K, int splits, int warps, DType dtype, std::uintptr_t stream);

// skinny_gemm followed, in the same grid, by fused_add_rms_norm(y, residual, norm_weight, eps) on its M rows
// (M <= kSkinnyAddNormMaxM, N % 8 == 0, y/residual/norm_weight 16-byte aligned): residual [M, N] += y in place,
// y = rms_norm(residual) * norm_weight, bit-identical to cuda::fused_add_rms_norm. The last CTA to finish a tile
// does it, elected by `done` (int32, zero before the call, left zero after it). Calls that share `done` must not
// run at once: on one stream they cannot, even as programmatic dependents, since a grid touches it only after
// pdl_wait, i.e. after the grid before it has completed (and re-zeroed it).
void skinny_gemm_add_norm(void* y, const void* x, const void* w, float* partials, int* counters, void* residual,
                          const void* norm_weight, int* done, float eps, int64_t M, int64_t N, int64_t K, int splits,
                          int warps, DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
