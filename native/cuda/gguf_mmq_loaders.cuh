// Every tile loader of the int8 tensor-core GGUF product (contract: gguf_mmq_tile.cuh) and the dispatch from a
// runtime type code to its loader, shared by gguf_mmq.cu and the host test of the loaders.
#pragma once
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

// Bytes of a K-element weight row as the CUDA kernels store it (gguf_block.cuh: the grouped types' layout).
template <class Q>
GGUF_HD constexpr int64_t loader_row_bytes(int64_t K) {
  return gguf::row_bytes(Q::kType, K);
}

}  // namespace candle_vllm::cuda::mmq
