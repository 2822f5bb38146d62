// Skinny GEMM for decode over a weight stored [K, N] (x @ W, cuBLAS's "NN"): y[M, N] = x[M, K] @ W[K, N] with
// M <= 16 (declared in plain C++ for the bindings). Why a second layout: cuBLASLt reads [K, N] weights 1-5 % faster at
// 17-64 tokens (benches/RESULTS.md, session 28; gate/up alone +1.0 % at batch 64 in the model, session 30), so a
// weight kept [K, N] needs a decode kernel that streams it as fast as skinny_gemm streams [N, K].
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

constexpr int kSkinnyKnMaxM = 16;
constexpr int kSkinnyKnStrip = 64;  // weight columns per CTA
constexpr int kSkinnyKnSlab = 16;   // k rows per slab (one mma k step)

// x [M, K], w [K, N], y share `dtype` (f16 or bf16); contiguous, 16-byte aligned, K % 16 == 0, N % 64 == 0,
// 1 <= M <= 16. The K range is cut into `splits` parts; with splits > 1 partials (f32, splits * M * N) hold their sums
// and counters (int32, N / 64, zero before the call, left zero) elect the CTA of a strip that adds them up. `warps`
// (4 or 8) interleave over a split's slabs, `stage_slabs` (1, 2 or 4) of them per warp at a time: with 1 the next
// slab's weights are loaded before the current one is multiplied, with 2 or 4 all their loads are issued together.
// silu_mul: W holds a gate/up projection with its columns interleaved in groups of 8 (the gates of features
// 8j..8j+7, then their ups: skinny_gemm's row layout, transposed; N % 64 == 0) and y [M, N / 2] receives
// silu(gate) * up, each rounded as the projection followed by silu_and_mul would round it.
void skinny_gemm_kn(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M, int64_t N,
                    int64_t K, int splits, int warps, int stage_slabs, bool silu_mul, DType dtype,
                    std::uintptr_t stream);

// CTAs of that launch (M tokens, `warps`, `stage_slabs`, the epilogue) one SM of the current device holds at once:
// the launch rule sizes its grids to one wave with it (a grid of 1.1 waves ran 30 % slower, benches/RESULTS.md).
int skinny_gemm_kn_ctas_per_sm(int64_t M, int warps, int stage_slabs, bool silu_mul, DType dtype);

}  // namespace candle_vllm::cuda
