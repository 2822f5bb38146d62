// Paged attention on CPU: every query token attends to its sequence's cached context through the block table.
// One code path for prefill chunks and decode; each (token, head) is computed alone in a fixed order, so a
// sequence's result never depends on which other sequences share the step (batch invariance).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cpu {

struct PagedAttentionArgs {
  void* out;                   // [T, Hq, D]
  const void* q;               // [T, Hq, D]
  const void* kv_cache;        // [2, num_blocks, block_size, Hk, D], or TurboQuant rows [num_blocks, block_size, Hk, R]
  const int32_t* block_tables; // [S, max_blocks]
  const int32_t* query_start_loc;  // [S + 1]
  const int32_t* seq_lens;     // [S]
  int64_t num_seqs, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks;
  float scale;
  int64_t sliding_window;  // 0 = none
  float softcap;           // 0 = none
  DType dtype;             // of q and out
  DType cache_dtype;       // of the cache: dtype, F8E4M3 (--kvcache-dtype fp8, read exactly as f32), or U8
  // With cache_dtype U8: TurboQuant rows (pyengine/kv_cache/turbo.py) whose K has 8 (e4m3), 4 or 3 bits a value;
  // 4 and 3 are rotated by signs [D] then the Walsh-Hadamard transform, and so is each query here.
  int turbo_k_bits = 0;
  const float* turbo_signs = nullptr;
};

void paged_attention(const PagedAttentionArgs& a);

// In place: H (signs * x) / sqrt(D), H the Walsh-Hadamard matrix in Sylvester order (D a power of two), with the f32
// operations of pyengine/kv_cache/turbo.py's rotate (TurboQuant keys, and the queries that read them).
void turbo_rotate(float* x, const float* signs, int64_t D);

// Throws std::invalid_argument unless turbo_k_bits / turbo_signs / head_dim describe TurboQuant rows the kernels read.
void check_turbo_rows(const PagedAttentionArgs& a);

// Throws std::invalid_argument for arguments paged_attention rejects (call before a parallel region).
void check_paged_attention(const PagedAttentionArgs& a);

// Sequence index of every query token [num_tokens], from query_start_loc (what paged_attention_share needs).
void token_sequences(const PagedAttentionArgs& a, int32_t* seq_of);

// paged_attention as a share of an enclosing OpenMP parallel region ((token, head) pairs split across its
// threads, no barrier at the end), for the fused decoder layer; alone outside a region it does every pair.
// The arguments must have passed check_paged_attention.
void paged_attention_share(const PagedAttentionArgs& a, const int32_t* seq_of);

}  // namespace candle_vllm::cpu
