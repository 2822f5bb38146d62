// Paged decode attention and the KV-cache write on CUDA (declared in plain C++ for the bindings).
// Cache layout (contracts.md C): [2, num_blocks, block_size, kv_heads, head_dim]; key_cache / value_cache
// point at its two halves; a flat slot is block_id * block_size + offset.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

constexpr int kAttnMaxGroup = 16;   // query heads per kv head (the rows of one warp's mma tile)
constexpr int kAttnCtaRow = 1024;   // cache elements of one token a decode CTA covers: 1024 / head_dim kv heads

// One query token per sequence: q [num_seqs, q_heads, head_dim] (sequence stride q_stride elements, heads
// contiguous) attends to seq_lens[s] cached tokens through block_tables [num_seqs, max_blocks] (int32).
// out [num_seqs, q_heads, head_dim] contiguous, same dtype as q (f16/bf16); the cache holds cache_dtype: q's, or
// F8E4M3 (an e4m3 cache, read as f16 mma operands: cuda/fp8_kv.cuh); head_dim 64/128/256.
// softcap <= 0 disables logit soft-capping; sliding_window <= 0 disables the window. With num_partitions > 1
// each sequence's attended span is cut at run time into num_partitions equal pieces of whole stages
// (split-KV), each at most partition_size rounded up to a stage: partial_out f32 [num_seqs, q_heads,
// num_partitions, head_dim] and partial_ml f32 [2, num_seqs, q_heads, num_partitions] hold the pieces until
// the reduce kernel (launched here too) combines them. num_partitions * partition_size must cover the longest
// context; the grid depends only on num_partitions, so a CUDA graph captured for the longest context serves
// every shorter one with all its CTAs busy. Any block_size works; powers of two take the shift path.
// reduce_counters null: a second kernel combines the pieces; else int32 [num_seqs * ceil(kv_heads /
// heads_per_cta)], all zero, and the last CTA of each (sequence, head group) combines them and re-zeroes its
// counter (so the buffer stays valid for the next call and graph replay). heads_per_cta kv heads per CTA, each
// with `splits` (1, 2 or 4) warps that share its tiles (at most 1024 / head_dim warps per CTA); pieces are
// whole stages of 16 * splits tokens. Launched as a programmatic dependent (common.cuh: launch_pdl): only tokens
// older than seq_len - 1 may be read before the previous kernel ends.
void paged_attention_decode(void* out, const void* q, const void* key_cache, const void* value_cache,
                            const int32_t* block_tables, const int32_t* seq_lens, float* partial_out,
                            float* partial_ml, int32_t* reduce_counters, int64_t num_seqs, int64_t q_heads,
                            int64_t kv_heads, int64_t head_dim, int64_t q_stride, int64_t block_size,
                            int64_t max_blocks, int64_t partition_size, int64_t num_partitions,
                            int64_t heads_per_cta, int64_t splits, float scale, float softcap,
                            int64_t sliding_window, DType dtype, DType cache_dtype, std::uintptr_t stream);

// key_cache/value_cache[slot_mapping[t]] = k[t], v[t]; k, v [tokens, kv_heads, head_dim] with token strides
// k_stride / v_stride (heads contiguous); slots < 0 are skipped (padding tokens). The cache holds cache_dtype:
// k's, or F8E4M3 (each value stored as cuda/fp8_kv.cuh's to_e4m3). A programmatic dependent launch that waits
// for the previous kernel before touching memory.
void reshape_and_cache(const void* k, const void* v, void* key_cache, void* value_cache, const int64_t* slot_mapping,
                       int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride,
                       DType dtype, DType cache_dtype, std::uintptr_t stream);

// k, v [tokens, kv_heads, head_dim] (f16/bf16, token strides k_stride / v_stride, heads contiguous) rounded in
// place to the values an e4m3 cache holds of them (cuda/fp8_kv.cuh's to_e4m3, read back exactly): what torch's
// prefill kernels attend to beside an e4m3 cache, so that every attention route reads the same values.
void round_to_e4m3(void* k, void* v, int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t k_stride,
                   int64_t v_stride, DType dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
