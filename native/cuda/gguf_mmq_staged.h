// The int8 tensor-core GGUF product with its weights streamed through shared memory (gguf_mmq_staged.cu), for
// decode batches of up to 8 tokens; called by launch_gguf_mmq (gguf_mmq.cu), which picks it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gguf.h"
#include "cuda/q8_activation.cuh"

namespace candle_vllm::cuda {

// launch_gguf_mmq's contract (gguf_mmq.h) for a call gguf_mmq_staged_fits (gguf.h) accepts, w 16-byte aligned;
// warps (4, 8 or 16) split K as the register kernel's do, so the results are that kernel's with the same warps.
void launch_gguf_mmq_staged(void* y, bool bf16, const int8_t* xq, const gguf::XBlock* xb, const uint8_t* w, int M,
                            int N, int K, int qtype, int warps, const GgufRopeCache* rope, cudaStream_t stream);

}  // namespace candle_vllm::cuda
