#include "cpu/quant_gemv.h"

#include <algorithm>
#include <stdexcept>

#include "cpu/dtype_io.h"
#include "cpu/quant_act.h"

namespace candle_vllm::cpu {
namespace {

// Activation rows handled per pass over the weights: their quantized blocks stay in L2 while every thread
// streams its share of weight rows past them.
constexpr int64_t kActRowsPerPass = 64;
// Below this many multiply-adds a call runs on one thread (fork/join would cost more than it saves).
constexpr int64_t kParallelMacs = 1 << 16;
// A tile reads several rows at once, which hides the stream from the hardware prefetchers when the weights come
// from DRAM: the bytes this far ahead are prefetched explicitly (measured on SmolLM2's 96 MB of weights, one
// thread: 14.1 ms per token without, 7.7 ms with; 1, 4 and 8 KiB all within 2%).
constexpr int64_t kPrefetchBytes = 2048;

template <typename IO>
void share(const MatmulActs& a, const uint8_t* w, int64_t row_bytes, int64_t n, typename IO::storage* y,
           int64_t ldy) {
  const int64_t m = a.m, k = a.k;
  // A single activation row gets the widest weight tile; batches share each decoded weight block across 2x4.
  const int64_t tile = m == 1 ? kDotWeightRows : 2;
  const int64_t tiles = (n + tile - 1) / tile;
  const int64_t w_bytes = n * row_bytes;
  for (int64_t m0 = 0; m0 < m; m0 += kActRowsPerPass) {
    const int64_t m1 = std::min(m, m0 + kActRowsPerPass);
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * tile;
      const int wrows = static_cast<int>(std::min(tile, n - r0));
      const int64_t ahead = r0 * row_bytes + kPrefetchBytes;
      for (int64_t off = 0; off < wrows * row_bytes && ahead + off < w_bytes; off += 64)
        __builtin_prefetch(w + ahead + off, 0, 3);
      for (int64_t i = m0; i < m1; i += kDotRows) {
        const int arows = static_cast<int>(std::min<int64_t>(kDotRows, m1 - i));
        float out[kDotWeightRows * kDotRows];
        a.kernel.fn(w + r0 * row_bytes, row_bytes, wrows, a.bytes.data() + i * a.stride, a.stride, k, arows, out);
        for (int r = 0; r < wrows; ++r)
          for (int j = 0; j < arows; ++j) y[(i + j) * ldy + r0 + r] = IO::store(out[r * arows + j]);
      }
    }
  }
}

}  // namespace

void prepare_matmul_acts(const void* x, DType dtype, QType t, int64_t m, int64_t k, bool portable, MatmulActs& a) {
  const QTypeInfo info = qtype_info(t);
  if (k % info.block != 0) throw std::invalid_argument("quant_matmul: in_features is not a multiple of the block size");
  a.kernel = dot_kernel(t, portable);
  a.m = m;
  a.k = k;
  switch (a.kernel.act) {
    case ActKind::F32: a.stride = k * static_cast<int64_t>(sizeof(float)); break;
    case ActKind::Q8x32: a.stride = k / QK * static_cast<int64_t>(sizeof(BlockQ8x32)); break;
    case ActKind::Q8xK: a.stride = k / QKK * static_cast<int64_t>(sizeof(BlockQ8xK)); break;
  }
  a.bytes.resize(static_cast<size_t>(m * a.stride));
  switch (a.kernel.act) {
    case ActKind::F32: act_to_f32(x, dtype, m, k, reinterpret_cast<float*>(a.bytes.data())); break;
    case ActKind::Q8x32: quantize_act_q8x32(x, dtype, m, k, reinterpret_cast<BlockQ8x32*>(a.bytes.data())); break;
    case ActKind::Q8xK: quantize_act_q8xk(x, dtype, m, k, reinterpret_cast<BlockQ8xK*>(a.bytes.data())); break;
  }
}

void quant_matmul_share(const MatmulActs& a, const uint8_t* w, QType t, int64_t n, void* y, int64_t ldy,
                        DType ydtype) {
  const QTypeInfo info = qtype_info(t);
  const int64_t row_bytes = a.k / info.block * info.bytes;
  switch (ydtype) {
    case DType::F32: return share<F32>(a, w, row_bytes, n, static_cast<float*>(y), ldy);
    case DType::F16: return share<F16>(a, w, row_bytes, n, static_cast<uint16_t*>(y), ldy);
    case DType::BF16: return share<BF16>(a, w, row_bytes, n, static_cast<uint16_t*>(y), ldy);
    default: throw std::invalid_argument("quant_matmul: activations must be f32, f16 or bf16");
  }
}

void quant_matmul(const void* x, DType dtype, const uint8_t* w, QType t, int64_t m, int64_t n, int64_t k, void* y,
                  bool portable) {
  if (dtype != DType::F32 && dtype != DType::F16 && dtype != DType::BF16)
    throw std::invalid_argument("quant_matmul: activations must be f32, f16 or bf16");
  if (k % qtype_info(t).block != 0)
    throw std::invalid_argument("quant_matmul: in_features is not a multiple of the block size");
  if (m <= 0 || n <= 0) return;
  MatmulActs acts;
  prepare_matmul_acts(x, dtype, t, m, k, portable, acts);
#pragma omp parallel if (m * n * k >= kParallelMacs)
  quant_matmul_share(acts, w, t, n, y, n, dtype);
}

}  // namespace candle_vllm::cpu
