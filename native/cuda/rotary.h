// Rotary position embedding on CUDA, in place on q and k (declared in plain C++ for the bindings).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"
#include "cuda/deferred_norm.h"

namespace candle_vllm::cuda {

// Which channels of a head form the rotation pairs: gptj (2i, 2i+1) or neox (i, i + rotary_dim/2).
enum RopeStyle : int { kRopeGptj = 0, kRopeNeox = 1 };

// pair_group (neox only): 0 for heads in the standard layout; 1 or 8 for heads stored with their halves
// interleaved in groups of that many channels (8: channels 8j..8j+7 then half+8j..half+8j+7, the bf16 skinny
// GEMM's tiles; 1: i then half+i, the GGUF GEMV's row pairs), the layout of a q/k/v projection whose decode GEMM
// rotates in its epilogue (f16/bf16 and rotary_dim == head_dim only). The kernels read that layout and leave the
// head in the standard one.

// q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] in `dtype` (f32/f16/bf16), heads contiguous
// within a token, token strides q_stride / k_stride in elements (so views into a fused qkv buffer work);
// positions int64 [tokens]; cos_sin f32 [max_pos, rotary_dim] (cos half then sin half). The first
// rotary_dim channels of each head rotate, paired by `style` (a RopeStyle) as stored per `pair_group`.
void rotary_embedding(void* q, void* k, const int64_t* positions, const float* cos_sin, int64_t tokens,
                      int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                      int64_t k_stride, int style, int pair_group, DType dtype, std::uintptr_t stream);

// rotary_embedding with rotary_dim == head_dim that also stores the rotated k and v [tokens, k_heads, head_dim]
// (token stride v_stride) into the paged cache halves [slots, k_heads, head_dim] at `slots` (int64 [tokens],
// negative = skip): the decode step's reshape_and_cache folded into the RoPE launch. Needs 16-byte aligned
// pointers and strides/head_dim in whole 16-byte vectors (rotary_vectorizable). With norm.rows set, q, k and v are
// first scaled by their token's 1/rms of those rows (deferred_norm.h), and v is written back scaled as well.
// The cache holds cache_dtype: q's, or F8E4M3 with f16/bf16 q (values stored as cuda/fp8_kv.cuh's to_e4m3).
void rotary_embedding_cache(void* q, void* k, void* v, const int64_t* positions, const float* cos_sin,
                            void* key_cache, void* value_cache, const int64_t* slots, int64_t tokens, int64_t q_heads,
                            int64_t k_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                            int style, int pair_group, DType dtype, DType cache_dtype, std::uintptr_t stream,
                            const DeferredNorm& norm = {});

}  // namespace candle_vllm::cuda
