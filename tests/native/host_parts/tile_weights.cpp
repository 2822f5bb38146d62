// Host driver for the tile loaders of the int8 tensor-core GGUF product (native/cuda/gguf_mmq_*.cuh): for every
// unit of every weight row and every lane t of a quad, fetch + pair (+ half_scales, half_mins) as multiply_unit
// calls them, and each of the lane's codes times its scale (w = a * code - b; a * sc * code - b * m for the halves'
// own scales and mins) written at the element the contract of gguf_mmq_tile.cuh gives it. Every element is written
// by exactly one lane, so the output is the whole dequantized row as the loaders see it.
//
//   tile_weights IN OUT   IN: int32 qtype, rows, K; rows * row_bytes weight bytes
//                         OUT: rows * K f64 weights (exit 3: the type has no tile loader)
#include <cstdint>
#include <vector>

#include "cuda/gguf_mmq_loaders.cuh"
#include "driver.h"

namespace mmq = candle_vllm::cuda::mmq;

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
          int sc[2][2] = {{1, 1}, {1, 1}}, mins[2][2] = {{1, 1}, {1, 1}};
          if constexpr (Q::kHalfScales) q.half_scales(j, sc);
          if constexpr (Q::kHalfMins) q.half_mins(j, mins);
          for (int h = 0; h < 2; ++h) {
            const uint32_t(&words)[2] = h ? hi : lo;
            for (int i = 0; i < 8; ++i) {
              const int e = slot<Q>(t, i), code = static_cast<int8_t>(words[i / 4] >> (8 * (i % 4)));
              const double scale = static_cast<double>(a[h]) * sc[h][e / 16];
              out[static_cast<int64_t>(r) * k + u * Q::kBlockElems + 64 * j + 32 * h + e] =
                  scale * code - static_cast<double>(b[h]) * mins[h][e / 16];
            }
          }
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return driver_main<double>(argc, argv, [](const Header& h, FILE* in, std::vector<double>& out, bool& ok) {
    return mmq::dispatch(h.qtype, [&](auto loader) {
      using Q = decltype(loader);
      const Weights w(in, static_cast<size_t>(h.rows) * (h.k / Q::kBlockElems) * Q::kBlockBytes);
      ok = w.ok();
      out.resize(static_cast<size_t>(h.rows) * h.k);
      if (ok) tile_weights<Q>(w.data(), h.rows, h.k, out.data());
    });
  });
}
