// Variable-length causal flash attention over the paged KV cache (prefill and mixed steps), declared in plain
// C++ for the bindings. Cache layout as in paged_attention.h: [2, num_blocks, block_size, kv_heads, head_dim];
// key_cache / value_cache point at its two halves.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

// Sequence s owns the flat query rows [query_start_loc[s], query_start_loc[s+1]) of q [T, q_heads, head_dim]
// (token stride q_stride elements, heads contiguous); its rows are the last q_len positions of a context of
// seq_lens[s] tokens, all of which (the new ones included) are already in the cache, reached through
// block_tables [num_seqs, max_blocks] (int32). Row i of the sequence (absolute position p = ctx - q_len + i)
// attends to keys at positions <= p (and > p - sliding_window when sliding_window > 0), query head h to kv head
// h / (q_heads / kv_heads). out [T, q_heads, head_dim] contiguous, same dtype (f16/bf16) as q. The cache
// (cache_dtype) is of q's dtype, or e4m3 (DType::F8E4M3, 1 byte a value, cuda/fp8_kv.cuh): then both products
// run as f16 mma (q and the softmax weights rounded to f16, the cached values exact in f16, f32 accumulation);
// any other cache_dtype throws std::invalid_argument. head_dim 64/128/256; softcap <= 0 disables soft-capping.
// max_query_len (host) sizes the grid. block_m is the query tile, warp_rows the rows each warp owns, block_n the
// keys per K/V tile; the instantiated combinations (the same for both cache types) are listed in
// pyengine/ops/cuda_prefill.py (KERNEL_CONFIGS). With skip_single_token, sequences with one query row are left
// unwritten (the decode kernel serves them).
void flash_prefill(void* out, const void* q, const void* key_cache, const void* value_cache,
                   const int32_t* block_tables, const int32_t* query_start_loc, const int32_t* seq_lens,
                   int64_t num_seqs, int64_t max_query_len, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                   int64_t q_stride, int64_t block_size, int64_t max_blocks, float scale, float softcap,
                   int64_t sliding_window, int64_t block_m, int64_t warp_rows, int64_t block_n,
                   bool skip_single_token, DType dtype, DType cache_dtype, std::uintptr_t stream);

}  // namespace candle_vllm::cuda
