// ISQ on the GPU: one thread per GGUF block runs the same per-block quantizer as the CPU path
// (cpu/quant_quantize_impl.h, IEEE-rounded intrinsics throughout), so the bytes equal the CPU's. Quantizing is a
// load-time pass; a thread per block keeps the K-quant scale searches simple and is far from the bottleneck.
#include <stdexcept>
#include <string>

#include "cpu/quant_quantize_impl.h"
#include "cuda/common.cuh"
#include "cuda/isq_quantize.h"

namespace candle_vllm::cuda {
namespace {

constexpr int kThreads = 128;

using BlockFn = void (*)(const float*, uint8_t*);

template <typename T, int kBlock, int kBytes, void (*Quantize)(const float*, uint8_t*)>
__global__ void __launch_bounds__(kThreads) isq_kernel(uint8_t* __restrict__ out, const T* __restrict__ x,
                                                       int64_t n_blocks) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (b >= n_blocks) return;
  float xb[kBlock];
  const T* src = x + b * kBlock;  // rows are whole blocks, so block b's elements are contiguous
#pragma unroll 8
  for (int i = 0; i < kBlock; ++i) xb[i] = to_f32(src[i]);
  Quantize(xb, out + b * kBytes);
}

template <typename T, int kBlock, int kBytes, void (*Quantize)(const float*, uint8_t*)>
void launch(uint8_t* out, const void* x, int64_t n_blocks, cudaStream_t stream) {
  const int64_t grid = (n_blocks + kThreads - 1) / kThreads;
  isq_kernel<T, kBlock, kBytes, Quantize>
      <<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(out, static_cast<const T*>(x), n_blocks);
  check_launch("isq_quantize");
}

template <typename T>
void dispatch(uint8_t* out, const void* x, int64_t elems, int qtype, cudaStream_t s) {
  const int64_t b32 = elems / isq::QK, b256 = elems / isq::QKK;
  switch (qtype) {
    case 2: return launch<T, 32, 18, isq::quantize_q4_0>(out, x, b32, s);
    case 3: return launch<T, 32, 20, isq::quantize_q4_1>(out, x, b32, s);
    case 6: return launch<T, 32, 22, isq::quantize_q5_0>(out, x, b32, s);
    case 7: return launch<T, 32, 24, isq::quantize_q5_1>(out, x, b32, s);
    case 8: return launch<T, 32, 34, isq::quantize_q8_0>(out, x, b32, s);
    case 10: return launch<T, 256, 84, isq::quantize_q2_k>(out, x, b256, s);
    case 11: return launch<T, 256, 110, isq::quantize_q3_k>(out, x, b256, s);
    case 12: return launch<T, 256, 144, isq::quantize_q4_k>(out, x, b256, s);
    case 13: return launch<T, 256, 176, isq::quantize_q5_k>(out, x, b256, s);
    case 14: return launch<T, 256, 210, isq::quantize_q6_k>(out, x, b256, s);
    default: throw std::invalid_argument("no ISQ quantizer for GGML type " + std::to_string(qtype));
  }
}

}  // namespace

void isq_quantize(uint8_t* out, const void* x, int64_t rows, int64_t cols, DType dtype, int qtype,
                  std::uintptr_t stream) {
  const int block = qtype >= 10 ? isq::QKK : isq::QK;
  if (cols % block) {
    throw std::invalid_argument("ISQ rows of " + std::to_string(cols) + " elements are not whole blocks of " +
                                std::to_string(block));
  }
  const cudaStream_t s = as_stream(stream);
  switch (dtype) {
    case DType::F32: return dispatch<float>(out, x, rows * cols, qtype, s);
    case DType::F16: return dispatch<__half>(out, x, rows * cols, qtype, s);
    case DType::BF16: return dispatch<__nv_bfloat16>(out, x, rows * cols, qtype, s);
    default: throw std::invalid_argument("ISQ input must be f32, f16 or bf16");
  }
}

}  // namespace candle_vllm::cuda
