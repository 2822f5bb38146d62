// Host driver for the GGUF dequantize decoders (native/cuda/gguf_decode*.cuh, Deq<Q>::slice): every 32-element
// slice of every weight row decoded as the dequantize / get_rows kernel's thread does, so the f32 rows can be
// compared with the `gguf` package's dequantizer bit for bit (the decoders repeat its order of f32 operations).
//
//   dequant_rows IN OUT   IN: int32 qtype, rows, K; rows * row_bytes weight bytes (gguf::row_bytes: the CUDA layout)
//                         OUT: rows * K f32 weights (exit 3: the type has no decoder)
#include <cstdint>
#include <vector>

#include "cuda/gguf_decode.cuh"
#include "driver.h"

namespace {

template <class D>
void dequant_rows(int qtype, const uint8_t* w, int rows, int k, float* out) {
  constexpr int kSlices = D::kBlockElems / 32;
  const int64_t row_bytes = candle_vllm::gguf::row_bytes(qtype, k);
  for (int r = 0; r < rows; ++r)
    for (int slice = 0; slice < k / 32; ++slice) {
      float v[32];
      D::slice(w + r * row_bytes + (slice / kSlices) * D::kBlockBytes, slice % kSlices, v);
      for (int i = 0; i < 32; ++i) out[static_cast<int64_t>(r) * k + 32 * slice + i] = v[i];
    }
}

}  // namespace

int main(int argc, char** argv) {
  return driver_main<float>(argc, argv, [](const Header& h, FILE* in, std::vector<float>& out, bool& ok) {
    return candle_vllm::gguf::dispatch_qtype(h.qtype, [&](auto decoder) {
      using D = decltype(decoder);
      const Weights w(in, static_cast<size_t>(h.rows) * candle_vllm::gguf::row_bytes(h.qtype, h.k));
      ok = w.ok();
      out.resize(static_cast<size_t>(h.rows) * h.k);
      if (ok) dequant_rows<D>(h.qtype, w.data(), h.rows, h.k, out.data());
    });
  });
}
