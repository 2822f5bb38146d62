// The int8 tensor-core GGUF product for decode batches of up to 32 tokens (gguf_mmq.cu); called by gguf_mmq in
// gguf_gemv_q8.cu, which checks the arguments and owns the activation quantizer.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gguf.h"
#include "cuda/q8_activation.cuh"

namespace candle_vllm::cuda {

// y[M, N] (f16 or bf16) = codes xq/xb [M, K] @ W[N, K]^T on the stream, 1 <= M <= kGgufMmqMaxM (gguf.h), K a
// multiple of the type's block, arguments already checked; a programmatic dependent of the kernel that wrote xq/xb.
// row_tiles: 16-row tiles per CTA (1 or 2), warps: warps per CTA splitting K (4, 8, or 16 with one row tile); 0 for
// the default rules.
// staging: which kernel (kMmqStaging*, gguf.h). rope non-null: the RoPE + cache epilogue of gguf_gemv_q8_rope_cache
// (arguments checked) instead of the plain store.
void launch_gguf_mmq(void* y, bool bf16, const int8_t* xq, const gguf::XBlock* xb, const uint8_t* w, int M, int N,
                     int K, int qtype, int row_tiles, int warps, int staging, const GgufRopeCache* rope,
                     cudaStream_t stream);

}  // namespace candle_vllm::cuda
