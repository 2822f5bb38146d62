// Host driver for the tile loaders of the int8 tensor-core GGUF product (native/cuda/gguf_mmq_*.cuh): for every
// unit of every weight row and every lane t of a quad, fetch + pair (+ half_scales) as multiply_unit calls them,
// and each of the lane's codes times its scale (w = a * code - b, or a * sc * code for kHalfScales) written at the
// element the contract of gguf_mmq_tile.cuh gives it. Every element is written by exactly one lane, so the output
// is the whole dequantized row as the loaders see it.
//
//   tile_weights IN OUT   IN: int32 qtype, rows, K; rows * row_bytes weight bytes
//                         OUT: rows * K f64 weights (exit 3: the type has no tile loader)
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/gguf_mmq_block32.cuh"
#include "cuda/gguf_mmq_kquants.cuh"
#include "weights.h"

namespace mmq = candle_vllm::cuda::mmq;
namespace gguf = candle_vllm::gguf;

namespace {

// The element (within its 32-element sub-block) of lane t's code i (0..7: word i / 4, byte i % 4).
template <class Q>
int slot(int t, int i) {
  if (Q::kSplitLanes) return (i < 4 ? 4 * t : 16 + 4 * t) + i % 4;
  return 8 * t + i;
}

template <class Q>
void tile_weights(const uint8_t* w, int rows, int k, double* out) {
  const int64_t row_bytes = static_cast<int64_t>(k / Q::kBlockElems) * Q::kBlockBytes;
  for (int r = 0; r < rows; ++r) {
    for (int u = 0; u < k / Q::kBlockElems; ++u) {
      for (int t = 0; t < 4; ++t) {
        Q q;
        q.fetch(w + r * row_bytes, u, t);
        for (int j = 0; j < Q::kPairs; ++j) {
          uint32_t lo[2], hi[2];
          float a[2], b[2];
          q.pair(j, t, lo, hi, a, b);
          int sc[2][2] = {{1, 1}, {1, 1}};
          if constexpr (Q::kHalfScales) q.half_scales(j, sc);
          for (int h = 0; h < 2; ++h) {
            const uint32_t(&words)[2] = h ? hi : lo;
            for (int i = 0; i < 8; ++i) {
              const int e = slot<Q>(t, i), code = static_cast<int8_t>(words[i / 4] >> (8 * (i % 4)));
              const double scale = static_cast<double>(a[h]) * sc[h][e / 16];
              out[static_cast<int64_t>(r) * k + u * Q::kBlockElems + 64 * j + 32 * h + e] =
                  scale * code - static_cast<double>(b[h]);
            }
          }
        }
      }
    }
  }
}

template <typename F>
bool dispatch(int qtype, F&& f) {
  switch (qtype) {
    case gguf::Q4_0: f(mmq::MmqQ4_0{}); return true;
    case gguf::Q4_1: f(mmq::MmqQ4_1{}); return true;
    case gguf::Q5_0: f(mmq::MmqQ5_0{}); return true;
    case gguf::Q5_1: f(mmq::MmqQ5_1{}); return true;
    case gguf::Q8_0: f(mmq::MmqQ8_0{}); return true;
    case gguf::Q4_K: f(mmq::MmqQ4K{}); return true;
    case gguf::Q5_K: f(mmq::MmqQ5K{}); return true;
    case gguf::Q6_K: f(mmq::MmqQ6K{}); return true;
    default: return false;
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
  std::vector<double> out(static_cast<size_t>(rows) * k);
  bool ok = true;
  const bool known = dispatch(qtype, [&](auto loader) {
    using Q = decltype(loader);
    const size_t wbytes = static_cast<size_t>(rows) * (k / Q::kBlockElems) * Q::kBlockBytes;
    // 16-byte aligned as the GPU tensor, and exactly its size: built with AddressSanitizer, a read past the last
    // block (the GPU's memcheck finding) fails the run.
    const Weights w(wbytes);
    ok = w.data() != nullptr && std::fread(w.data(), 1, wbytes, in) == wbytes;
    if (ok) tile_weights<Q>(w.data(), rows, k, out.data());
  });
  std::fclose(in);
  if (!known) return 3;
  if (!ok) return 2;
  FILE* o = std::fopen(argv[2], "wb");
  if (o == nullptr || std::fwrite(out.data(), sizeof(double), out.size(), o) != out.size()) return 2;
  std::fclose(o);
  return 0;
}
