// Host driver for the GEMV view of the GGUF decoders (native/cuda/gguf_decode*.cuh: Deq<Q>::codes / elem /
// scales, the f16/bf16 tensor-core GEMV's A operand): for every 256-element unit of every weight row, every 32-element
// step the unit has and every lane t of a quad, each of the lane's 4 pairs of codes turned into weights, w = (code -
// kOffset) * a + b, and written at the elements elem() names, with the scales loaded as gguf_gemv.cu loads them
// (per step, or once per unit). Every element is written by exactly one pair.
//
//   gemv_weights IN OUT   IN: int32 qtype, rows, K; rows * row_bytes weight bytes (gguf::row_bytes: the CUDA layout)
//                         OUT: rows * K f64 weights (exit 3: the type has no decoder)
#include <cstdint>
#include <vector>

#include "cuda/gguf_decode.cuh"
#include "driver.h"

namespace gguf = candle_vllm::gguf;

namespace {

template <class D>
void gemv_weights(int qtype, const uint8_t* w, int rows, int k, double* out) {
  constexpr int kUnitBlocks = gguf::kUnitElems / D::kBlockElems;
  const int blocks = k / D::kBlockElems;
  const int64_t row_bytes = candle_vllm::gguf::row_bytes(qtype, k);
  for (int r = 0; r < rows; ++r)
    for (int u = 0; u * kUnitBlocks < blocks; ++u) {
      const uint8_t* unit = w + r * row_bytes + static_cast<int64_t>(u) * kUnitBlocks * D::kBlockBytes;
      const int blocks_here = blocks - u * kUnitBlocks < kUnitBlocks ? blocks - u * kUnitBlocks : kUnitBlocks;
      const int steps = blocks_here * D::kBlockElems / 32;
      for (int t = 0; t < 4; ++t)
        for (int s = 0; s < steps; ++s) {
          float a[4], b[4];
          D::scales(unit, D::kScalesPerStep ? s : 0, t, a, b);
          uint32_t c[4];
          D::codes(unit, s, t, c);
          for (int j = 0; j < 4; ++j) {
            const int64_t e = static_cast<int64_t>(r) * k + u * gguf::kUnitElems + D::elem(s, t, j);
            for (int i = 0; i < 2; ++i) {
              const int code = static_cast<int>((c[j] >> (16 * i)) & 0xFFFF) - D::kOffset;
              out[e + i] = static_cast<double>(code) * a[j] + b[j];
            }
          }
        }
    }
}

}  // namespace

int main(int argc, char** argv) {
  return driver_main<double>(argc, argv, [](const Header& h, FILE* in, std::vector<double>& out, bool& ok) {
    return gguf::dispatch_qtype(h.qtype, [&](auto decoder) {
      using D = decltype(decoder);
      const Weights w(in, static_cast<size_t>(h.rows) * candle_vllm::gguf::row_bytes(h.qtype, h.k));
      ok = w.ok();
      out.assign(static_cast<size_t>(h.rows) * h.k, 0.0);
      if (ok) gemv_weights<D>(h.qtype, w.data(), h.rows, h.k, out.data());
    });
  });
}
