// Every tile loader of the int8 tensor-core GGUF product (contract: gguf_mmq_tile.cuh) and the dispatch from a
// runtime type code to its loader, shared by gguf_mmq.cu and the host test of the loaders.
#pragma once
#include <type_traits>

#include "cuda/gguf_mmq_block32.cuh"
#include "cuda/gguf_mmq_kquants.cuh"

namespace candle_vllm::cuda::mmq {

// Calls f(loader) with the tile loader of the type; false for types without one.
template <typename F>
GGUF_HD bool dispatch(int qtype, F&& f) {
  switch (qtype) {
    case gguf::Q4_0: f(MmqQ4_0{}); return true;
    case gguf::Q4_1: f(MmqQ4_1{}); return true;
    case gguf::Q5_0: f(MmqQ5_0{}); return true;
    case gguf::Q5_1: f(MmqQ5_1{}); return true;
    case gguf::Q8_0: f(MmqQ8_0{}); return true;
    case gguf::Q2_K: f(MmqQ2K{}); return true;
    case gguf::Q3_K: f(MmqQ3K{}); return true;
    case gguf::Q4_K: f(MmqQ4K{}); return true;
    case gguf::Q5_K: f(MmqQ5K{}); return true;
    case gguf::Q6_K: f(MmqQ6K{}); return true;
    default: return false;
  }
}

// Bytes of a K-element weight row as the CUDA kernels store it (gguf_block.cuh: the grouped layout of Q6_K, Q3_K,
// Q8_0 and Q5_0).
template <class Q>
GGUF_HD constexpr int64_t loader_row_bytes(int64_t K) {
  if constexpr (std::is_same_v<Q, MmqQ6K>) return gguf::grouped_row_bytes<gguf::Q6_K>(K);
  else if constexpr (std::is_same_v<Q, MmqQ3K>) return gguf::grouped_row_bytes<gguf::Q3_K>(K);
  else if constexpr (std::is_same_v<Q, MmqQ8_0>) return gguf::grouped_row_bytes<gguf::Q8_0>(K);
  else if constexpr (std::is_same_v<Q, MmqQ5_0>) return gguf::grouped_row_bytes<gguf::Q5_0>(K);
  else return K / Q::kBlockElems * Q::kBlockBytes;
}

}  // namespace candle_vllm::cuda::mmq
