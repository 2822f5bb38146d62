// The tensor-core TurboQuant decode kernel (turbo_decode_tc.cu), launched by turbo_decode_attention (turbo_decode.cu)
// where it takes the geometry; internal to native/cuda.
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

struct TurboDecodeArgs {
  void* out;
  const void* q;
  int64_t q_stride;  // elements between two sequences' queries (heads packed)
  const void* cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const float* signs;
  float* partials;
  int q_heads, kv_heads, block_size, max_blocks, piece_unit;
  float scale;
  int sliding_window;
  float softcap, sqrt_d;
};

// Whether the kernel takes this geometry: head_dim 64 or 128, block_size a multiple of 16, whole 32-bit words of
// codes per thread (not 3-bit keys at head_dim 64).
bool turbo_decode_tc_takes(int64_t head_dim, int k_bits, int64_t block_size);

// Launches the kernel over grid (parts, kv heads x chunks of 8 q heads, sequences) and returns true when it takes
// the geometry (turbo_decode_tc_takes); false, launching nothing, otherwise.
bool turbo_decode_tc(const TurboDecodeArgs& a, int64_t num_seqs, int64_t parts, int head_dim, int k_bits, DType dtype,
                     std::uintptr_t stream);

}  // namespace candle_vllm::cuda
