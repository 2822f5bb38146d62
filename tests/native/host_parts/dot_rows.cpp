// Host driver for the dp4a GGUF Parts (native/cuda/gguf_q8*.cuh, whose CUDA intrinsics have host fallbacks): each
// output is one weight row dotted with one token of int8 activation codes, summed Part by Part exactly as a GEMV
// thread walks its slots (fetch, decode, load_x, dot), so the Parts' decoding and scaling run without a GPU.
//
//   dot_rows IN OUT   IN: int32 qtype, rows, K; rows * row_bytes weight bytes (gguf::row_bytes: the CUDA layout); K int8 codes; K / 32 XBlocks
//                     OUT: rows f64 sums (exit 3: the type has no Part)
#include <cstdint>
#include <vector>

#include "cuda/gguf_q8.cuh"
#include "driver.h"

using candle_vllm::gguf::XBlock;

namespace {

template <class Q>
void dot_rows(int qtype, const uint8_t* w, int rows, int k, const int8_t* xq, const XBlock* xb, double* out) {
  const int64_t row_bytes = candle_vllm::gguf::row_bytes(qtype, k);
  for (int r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (int b = 0; b < k / Q::kBlockElems; ++b) {
      const uint8_t* blk = w + r * row_bytes + static_cast<int64_t>(b) * Q::kBlockBytes;
      for (int p = 0; p < Q::kParts; ++p) {
        typename Q::Raw raw;
        Q::fetch(raw, blk, p);
        Q part;
        part.decode(raw, blk, p);
        typename Q::X x;
        Q::load_x(x, xq + b * Q::kBlockElems, xb + b * (Q::kBlockElems / 32), p);
        sum += part.dot(x);
      }
    }
    out[r] = sum;
  }
}

}  // namespace

int main(int argc, char** argv) {
  return driver_main<double>(argc, argv, [](const Header& h, FILE* in, std::vector<double>& out, bool& ok) {
    return candle_vllm::gguf::dispatch_q8(h.qtype, [&](auto part) {
      using Q = decltype(part);
      const Weights w(in, static_cast<size_t>(h.rows) * candle_vllm::gguf::row_bytes(h.qtype, h.k));
      std::vector<int8_t> xq(h.k);
      std::vector<XBlock> xb(h.k / 32);
      ok = w.ok() && read_all(in, xq.data(), xq.size()) && read_all(in, xb.data(), xb.size() * sizeof(XBlock));
      out.resize(h.rows);
      if (ok) dot_rows<Q>(h.qtype, w.data(), h.rows, h.k, xq.data(), xb.data(), out.data());
    });
  });
}
