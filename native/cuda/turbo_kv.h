// TurboQuant KV cache rows on CUDA (pyengine/kv_cache/turbo.py holds the layout and the torch reference): the cache
// write (K rotated and coded, V coded, each with its f32 absmax; turbo_kv.cu, with the RoPE turbo_rope.cu), the
// paged decode attention over the rows (turbo_decode.cu) and the rows decoded to dense blocks (declared in plain C++
// for the bindings). Why kernels of their own: the torch reference decodes every cached row
// to f32 each step and writes through a dozen small ops a layer, which CUDA graphs cannot hold either.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"
#include "cuda/deferred_norm.h"

namespace candle_vllm::cuda {

// k, v [T, Hk, D] (f16/bf16; token strides k_stride / v_stride elements, heads packed) into rows of `cache`
// [blocks * block_size, Hk, R] at flat slots [T] (int64; < 0 skipped). k_bits 8 (e4m3 K), 4 or 3 (K rotated by
// signs [D] f32 and the Walsh-Hadamard transform first); D 64, 128 or 256. round_trip: k and v are then overwritten
// with the values their rows decode to (K turned back), so a dense attention over the step's own K/V (torch's
// cuDNN / flash kernels for fresh prompts) sees what later steps read from the cache.
void turbo_cache_write(const void* k, const void* v, void* cache, const int64_t* slots, const float* signs,
                       int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride,
                       int k_bits, bool round_trip, DType dtype, std::uintptr_t stream);

// out [S, Hq, D] = attention of each sequence's one new query q [S, Hq, D] (f16/bf16, heads packed, sequences
// q_stride elements apart: a view into a fused qkv buffer needs no copy) over its cached
// rows (seq_lens [S] int32 on the device, block_tables [S, max_blocks] int32). Each sequence's attended span is cut
// into `parts` pieces of equal length rounded up to `piece_unit` tokens, so the grid does not depend on the contexts
// (a CUDA graph keeps it) and pieces past a short span do nothing; with parts > 1 `partials` (f32, S * Hq * parts *
// (D + 2)) holds each live piece's max, sum and unnormalised output for a second kernel to combine. sliding_window
// 0: none; softcap 0: none. tensor_cores: the tensor-core kernel (turbo_decode_tc.cu) where it takes the geometry,
// else (and when false) the CUDA-core one.
void turbo_decode_attention(void* out, const void* q, int64_t q_stride, const void* cache,
                            const int32_t* block_tables, const int32_t* seq_lens, const float* signs,
                            float* partials, int64_t num_seqs,
                            int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t max_blocks, int64_t parts, int64_t piece_unit, float scale,
                            int64_t sliding_window, float softcap, int k_bits, bool tensor_cores, DType dtype,
                            std::uintptr_t stream);

// The rows of the listed cache blocks (int64 [num_blocks]) decoded into dense blocks out [2, num_blocks, block_size,
// Hk, D] (f16/bf16): K turned back from its rotation, so the flash prefill kernel (or any dense attention) reads
// them with unrotated queries. Prefill steps over a TurboQuant cache attend through these.
void turbo_blocks_to_dense(void* out, const void* cache, const int64_t* blocks, const float* signs, int64_t num_blocks,
                           int64_t block_size, int64_t kv_heads, int64_t head_dim, int k_bits, DType dtype,
                           std::uintptr_t stream);

// RoPE on q and k (whole heads; style 0 gptj, 1 neox; pair_group 1 or 8: neox q/k heads stored with their halves
// interleaved, see rotary.h) and the rows of k and v written at their slots, in one launch (turbo_rope.cu). q, k
// and v [T, H, D] (f16/bf16, heads packed, token strides *_stride) come out rotated (q) and as their rows decode to
// (k turned back, v); a token with a negative slot writes no row and keeps its rotated k and its v. cos_sin [*, D]
// f32, positions / slots [T] int64. norm: q, k and v are first scaled by each token's 1/rms.
struct TurboRopeArgs {
  void* q;
  void* k;
  void* v;
  const int64_t* positions;
  const float* cos_sin;
  uint8_t* cache;
  const int64_t* slots;
  const float* signs;
  int64_t tokens, q_stride, k_stride, v_stride;
  int q_heads, k_heads, k_bits, style, pair_group;
  float sqrt_d;
  DeferredNorm norm;
};
void turbo_rope_cache_write(const TurboRopeArgs& args, int64_t head_dim, DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
