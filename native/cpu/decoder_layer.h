// A Llama-family decoder stack on CPU in one native call per layer: the fused add-RMSNorm, the qkv projection
// (GGUF blocks, any supported type, through the quantized matmul kernels), the optional bias and q/k RMSNorm, RoPE
// (neox or gptj layout, from the cos/sin table), the K/V write into the paged cache, paged attention, the o
// projection, the residual add-RMSNorm, gate_up, and (after the caller's SiLU-and-mul) down.
//
// Every stage calls the kernels the op-by-op path calls (their *_share entry points), in the same order, and the
// element-wise glue (bias add, RoPE) rounds like the torch ops it replaces, so the result is bitwise that of the
// op-by-op path; the threads split each stage's rows and meet at a spin barrier between stages, instead of one
// OpenMP fork/join per kernel and a Python dispatch per op.
#pragma once
#include <cstdint>
#include <vector>

#include "cpu/quant_blocks.h"

namespace candle_vllm::cpu {

// `rows` output rows of a projection, stored as GGUF blocks of type `t` (F32/F16/BF16 included).
struct LinearPart {
  const uint8_t* w;
  QType t;
  int64_t rows;
};

// A projection whose output columns are its parts' outputs side by side (a GGUF file may store q/k and v in
// different types), plus an optional f32 bias over all columns.
struct LayerLinear {
  std::vector<LinearPart> parts;
  const float* bias = nullptr;
  int64_t in = 0;
  int64_t out() const;
};

// One layer's geometry and weights (f32 activations; the caller keeps the buffers alive).
struct DecoderLayerWeights {
  int64_t hidden = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, intermediate = 0;
  float eps = 0.f, scale = 0.f;
  int64_t sliding_window = 0;  // 0 = none
  const float* input_norm = nullptr;
  const float* post_norm = nullptr;
  const float* q_norm = nullptr;  // [head_dim] each, both null without q/k norm
  const float* k_norm = nullptr;
  LayerLinear qkv, o, gate_up, down;
  const float* cos_sin = nullptr;  // [max_positions, rotary_dim]: cos in the first half of a row, sin in the second
  int64_t rotary_dim = 0, max_positions = 0;
  bool is_neox = true;
};

// Throws std::invalid_argument naming the first inconsistency (shapes, block sizes, head counts).
void check_decoder_layer(const DecoderLayerWeights& w);

// What every layer of a step shares: the flat token batch and the paged cache geometry.
struct DecoderStep {
  int64_t num_tokens = 0, num_seqs = 0;
  const int64_t* positions = nullptr;     // [T]
  const int64_t* slot_mapping = nullptr;  // [T] flat cache slots
  const int32_t* block_tables = nullptr;  // [S, max_blocks]
  int64_t max_blocks = 0;
  const int32_t* query_start_loc = nullptr;  // [S + 1]
  const int32_t* seq_lens = nullptr;         // [S]
  int64_t num_blocks = 0, block_size = 0;    // of every layer's cache [2, num_blocks, block_size, Hk, D]
  bool cache_e4m3 = false;                   // the caches hold e4m3 (--kvcache-dtype fp8), else f32
  // 8 / 4 / 3: the caches hold TurboQuant rows [num_blocks, block_size, Hk, R] (pyengine/kv_cache/turbo.py) whose K
  // has that many bits, rotated (4 / 3) by turbo_signs [D] and the Walsh-Hadamard transform; 0: dense caches.
  int turbo_k_bits = 0;
  const float* turbo_signs = nullptr;
};

// Throws std::invalid_argument when a position is outside a layer's rotary table, a slot outside the caches, or
// an output row outside the batch (call once per step, before the segments).
void check_decoder_step(const std::vector<const DecoderLayerWeights*>& layers, const DecoderStep& step,
                        const int64_t* out_rows, int64_t num_out_rows);

// One native call of a step, in one OpenMP parallel region. SiLU-and-mul stays with the caller (torch's kernel, so
// the stack rounds exactly as the op-by-op path), so a step is layers.size() + 1 segments, `layer` = 0, 1, ...:
//   - unless `layer` is 0: layer - 1's down projection of `act` (its SiLU-and-mul output) into x;
//   - unless `layer` is layers.size(): layer `layer` up to its gate_up projection, written to `gate_up`
//     [rows, 2 * intermediate].
// x [T, hidden] starts as the embeddings (segment 0 sets residual = x before the first norm) and ends as the last
// layer's MLP output; residual [T, hidden] is the residual stream. With `out_rows` (num_out_rows indices into the
// T tokens) the last layer's o projection and MLP run for those rows only ("rows" above), and x/residual rows
// [0, num_out_rows) hold them; every token's K/V still reach the caches. kv_caches[i] is layer i's cache.
void decoder_segment(const std::vector<const DecoderLayerWeights*>& layers, const std::vector<void*>& kv_caches,
                     const DecoderStep& step, size_t layer, const float* act, float* gate_up, float* x,
                     float* residual, const int64_t* out_rows, int64_t num_out_rows);

}  // namespace candle_vllm::cpu
