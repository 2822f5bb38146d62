// Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 16 (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

constexpr int kSkinnyMaxM = 16;
constexpr int kSkinnyRowsPerTile = 16;
constexpr int kSkinnyChunkK = 128;

// x, w, y share `dtype` (f16 or bf16); contiguous, 16-byte aligned, K % 8 == 0, 1 <= M <= 16.
// With splits > 1, the K range is cut into `splits` parts: partials (f32, splits*M*N) hold their sums and
// counters (int32, ceil(N/16), all zero before the call; left zero after it) elect the CTA that adds them up.
// `warps` (4 or 8) is the CTA size: the warps of a tile's CTA interleave over its K chunks, so 8 keep twice the
// weight bytes in flight per tile where there are too few tiles for several CTAs per SM.
// silu_mul: W holds a gate/up projection with its rows interleaved in groups of 8 (gate 8j..8j+7, then up
// 8j..8j+7; N % 16 == 0) and y [M, N / 2] receives silu(gate) * up, each product rounded as the projection
// followed by silu_and_mul would round it.
void skinny_gemm(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M, int64_t N,
                 int64_t K, int splits, int warps, bool silu_mul, DType dtype, std::uintptr_t stream);

// What the RoPE + cache epilogue needs besides the GEMM's operands. W is a fused q/k/v projection whose first
// rot_rows rows (q then k heads, head_dim rows each) have each head's two halves interleaved in groups of 8
// (channels 8j..8j+7, then half+8j..half+8j+7), so a 16-row tile holds both members of 8 rotation pairs.
struct SkinnyRopeCache {
  const int64_t* positions;  // [M] token positions
  const float* cos_sin;      // [max_pos, head_dim] f32: cos then sin of each position (neox pairs)
  void* key_cache;           // flat [slots, kv_heads, head_dim] in the GEMM's dtype, or e4m3 (cache_e4m3)
  void* value_cache;
  const int64_t* slots;      // [M] cache slot per token; < 0: not stored
  int q_rows, rot_rows, head_dim, kv_heads;
  bool cache_e4m3;           // the cache holds e4m3 (cuda/fp8_kv.cuh's to_e4m3 of each stored value)
};

// skinny_gemm whose epilogue rotates q and k (neox RoPE, cos/sin rounded to T as rotary_embedding does) and
// stores k and v at the tokens' cache slots: y [M, N] is left exactly as the projection (de-interleaved to the
// standard head layout) followed by rotary_embedding_cache would leave it, and so is the cache.
void skinny_gemm_rope_cache(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M,
                            int64_t N, int64_t K, int splits, int warps, const SkinnyRopeCache& rope, DType dtype,
                            std::uintptr_t stream);

}  // namespace candle_vllm::cuda
