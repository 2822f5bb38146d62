// GGUF dequantize / get_rows: one thread decodes 32 consecutive elements of one block (gguf's f32 arithmetic,
// see gguf_decode.cuh) and writes them with 16-byte stores. Prefill and large batches multiply the result with
// cuBLAS; the embedding gathers its rows straight from the quantized table through `ids`.
#include "cuda/common.cuh"
#include "cuda/gguf.h"
#include "cuda/gguf_decode.cuh"

namespace candle_vllm::cuda {
namespace {

template <typename T, class D>
__global__ void gguf_dequant_kernel(T* __restrict__ out, const uint8_t* __restrict__ w,
                                    const int64_t* __restrict__ ids, int64_t rows, int64_t cols, int64_t row_bytes) {
  const int64_t slices_per_row = cols / 32;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * slices_per_row) return;
  const int64_t row = i / slices_per_row, slice = i % slices_per_row;
  constexpr int kSlices = D::kBlockElems / 32;
  const int64_t src = ids != nullptr ? ids[row] : row;
  const uint8_t* block = w + src * row_bytes + (slice / kSlices) * D::kBlockBytes;
  float v[32];
  D::slice(block, static_cast<int>(slice % kSlices), v);
  constexpr int kPerVec = 16 / sizeof(T);
  auto* dst = reinterpret_cast<Vec<T, kPerVec>*>(out + row * cols + slice * 32);
#pragma unroll
  for (int q = 0; q < 32 / kPerVec; ++q) {
    Vec<T, kPerVec> vec;
#pragma unroll
    for (int e = 0; e < kPerVec; ++e) vec.v[e] = from_f32<T>(v[q * kPerVec + e]);
    dst[q] = vec;
  }
}

}  // namespace

bool gguf_supported(int qtype) {
  return gguf::dispatch_qtype(qtype, [](auto) {});
}

void gguf_dequantize(void* out, const uint8_t* w, const int64_t* ids, int64_t rows, int64_t cols, int qtype,
                     DType dtype, std::uintptr_t stream) {
  if (rows < 0 || cols <= 0) throw std::invalid_argument("gguf_dequantize: needs rows >= 0 and cols > 0");
  if (!aligned16(out, w)) throw std::invalid_argument("gguf_dequantize: out and w must be 16-byte aligned");
  if (rows == 0) return;
  const bool known = gguf::dispatch_qtype(qtype, [&](auto tag) {
    using D = decltype(tag);
    if (cols % D::kBlockElems != 0)
      throw std::invalid_argument("gguf_dequantize: cols must be a whole number of blocks");
    const int64_t row_bytes = gguf::row_bytes(qtype, cols);
    const int64_t threads = rows * (cols / 32);
    const unsigned grid = static_cast<unsigned>((threads + 255) / 256);
    dispatch_float<true>(dtype, "gguf_dequantize", [&](auto t) {
      using T = decltype(t);
      gguf_dequant_kernel<T, D><<<grid, 256, 0, as_stream(stream)>>>(static_cast<T*>(out), w, ids, rows, cols,
                                                                     row_bytes);
    });
  });
  if (!known) throw std::invalid_argument("gguf_dequantize: unsupported GGUF type " + std::to_string(qtype));
  check_launch("gguf_dequantize");
}

}  // namespace candle_vllm::cuda
