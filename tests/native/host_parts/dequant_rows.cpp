// Host driver for the GGUF dequantize decoders (native/cuda/gguf_decode*.cuh, Deq<Q>::slice): every 32-element
// slice of every weight row decoded as the dequantize / get_rows kernel's thread does, so the f32 rows can be
// compared with the `gguf` package's dequantizer bit for bit (the decoders repeat its order of f32 operations).
//
//   dequant_rows IN OUT   IN: int32 qtype, rows, K; rows * row_bytes weight bytes
//                         OUT: rows * K f32 weights (exit 3: the type has no decoder)
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/gguf_decode.cuh"
#include "weights.h"

namespace {

template <class D>
void dequant_rows(const uint8_t* w, int rows, int k, float* out) {
  constexpr int kSlices = D::kBlockElems / 32;
  const int64_t row_bytes = static_cast<int64_t>(k / D::kBlockElems) * D::kBlockBytes;
  for (int r = 0; r < rows; ++r)
    for (int slice = 0; slice < k / 32; ++slice) {
      float v[32];
      D::slice(w + r * row_bytes + (slice / kSlices) * D::kBlockBytes, slice % kSlices, v);
      for (int i = 0; i < 32; ++i) out[static_cast<int64_t>(r) * k + 32 * slice + i] = v[i];
    }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (in == nullptr) return 2;
  int32_t head[3];
  if (std::fread(head, sizeof head, 1, in) != 1) return 2;
  const int qtype = head[0], rows = head[1], k = head[2];
  std::vector<float> out(static_cast<size_t>(rows) * k);
  bool ok = true;
  const bool known = candle_vllm::gguf::dispatch_qtype(qtype, [&](auto decoder) {
    using D = decltype(decoder);
    const size_t wbytes = static_cast<size_t>(rows) * (k / D::kBlockElems) * D::kBlockBytes;
    const Weights w(wbytes);
    ok = w.data() != nullptr && std::fread(w.data(), 1, wbytes, in) == wbytes;
    if (ok) dequant_rows<D>(w.data(), rows, k, out.data());
  });
  std::fclose(in);
  if (!known) return 3;
  if (!ok) return 2;
  FILE* o = std::fopen(argv[2], "wb");
  if (o == nullptr || std::fwrite(out.data(), sizeof(float), out.size(), o) != out.size()) return 2;
  std::fclose(o);
  return 0;
}
