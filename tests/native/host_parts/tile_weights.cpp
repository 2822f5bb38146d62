// Host driver for the tile loaders of the int8 tensor-core GGUF product (native/cuda/gguf_mmq_*.cuh): for every
// unit of every weight row and every lane t of a quad, fetch + pair (the 32-element types: w = a * code - b) or
// codes + unit_scales + scales_mins / half_scales / half_mins (the K-quants: w = d * sc * code - dmin * m) as the
// kernel calls them, and each of the lane's weights written at the element the contract of gguf_mmq_tile.cuh gives
// it. Every element is written by exactly one lane, so the output is the whole dequantized row as the loaders see
// it.
//
//   tile_weights IN OUT   IN: int32 qtype, rows, K; rows * row_bytes weight bytes (gguf::row_bytes: the CUDA layout)
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

// The lane's weights of sub-blocks 2j (h = 0) and 2j + 1 as multiply_unit / multiply_unit_k take them: scale[h][half]
// and offset[h][half] with w = scale * code - offset.
template <class Q>
void pair_weights(const Q& q, int j, int t, uint32_t (&lo)[2], uint32_t (&hi)[2], double (&scale)[2][2],
                  double (&offset)[2][2]) {
  if constexpr (Q::kUnitScales) {
    q.codes(j, t, lo, hi);
    float d, dmin;
    q.unit_scales(d, dmin);
    int sc[2][2], mins[2][2] = {};
    if constexpr (Q::kHalfScales) {
      q.half_scales(j, sc);
    } else {
      uint32_t scw, mw;
      q.scales_mins(j, scw, mw);
      for (int h = 0; h < 2; ++h)
        for (int half = 0; half < 2; ++half)
          sc[h][half] = (scw >> (8 * h)) & 0xFF, mins[h][half] = (mw >> (8 * h)) & 0xFF;
    }
    if constexpr (Q::kHalfMins) q.half_mins(j, mins);
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half)
        scale[h][half] = static_cast<double>(d) * sc[h][half], offset[h][half] = static_cast<double>(dmin) * mins[h][half];
  } else {
    float a[2], b[2];
    q.pair(j, t, lo, hi, a, b);
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) scale[h][half] = a[h] * mmq::kOutputScale<Q>, offset[h][half] = b[h];
  }
}

template <class Q>
void tile_weights(int qtype, const uint8_t* w, int rows, int k, double* out) {
  const int64_t row_bytes = candle_vllm::gguf::row_bytes(qtype, k);
  for (int r = 0; r < rows; ++r) {
    for (int u = 0; u < k / Q::kBlockElems; ++u) {
      for (int t = 0; t < 4; ++t) {
        Q q;
        q.fetch(w + r * row_bytes, u, t);
        for (int j = 0; j < Q::kPairs; ++j) {
          uint32_t lo[2], hi[2];
          double scale[2][2], offset[2][2];
          pair_weights(q, j, t, lo, hi, scale, offset);
          for (int h = 0; h < 2; ++h) {
            const uint32_t(&words)[2] = h ? hi : lo;
            for (int i = 0; i < 8; ++i) {
              const int e = slot<Q>(t, i), code = static_cast<int8_t>(words[i / 4] >> (8 * (i % 4)));
              out[static_cast<int64_t>(r) * k + u * Q::kBlockElems + 64 * j + 32 * h + e] =
                  scale[h][e / 16] * code - offset[h][e / 16];
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
      const Weights w(in, static_cast<size_t>(h.rows) * candle_vllm::gguf::row_bytes(h.qtype, h.k));
      ok = w.ok();
      out.resize(static_cast<size_t>(h.rows) * h.k);
      if (ok) tile_weights<Q>(h.qtype, w.data(), h.rows, h.k, out.data());
    });
  });
}
