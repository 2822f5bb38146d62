// Host driver for the dp4a GGUF Parts (native/cuda/gguf_q8*.cuh, whose CUDA intrinsics have host fallbacks): each
// output is one weight row dotted with one token of int8 activation codes, summed Part by Part exactly as a GEMV
// thread walks its slots (fetch, decode, load_x, dot), so the Parts' decoding and scaling run without a GPU.
//
//   dot_rows IN OUT   IN: int32 qtype, rows, K; rows * row_bytes weight bytes; K int8 codes; K / 32 XBlocks
//                     OUT: rows f64 sums (exit 3: the type has no Part)
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/gguf_q8.cuh"
#include "weights.h"

using candle_vllm::gguf::XBlock;

namespace {

template <class Q>
void dot_rows(const uint8_t* w, int rows, int k, const int8_t* xq, const XBlock* xb, double* out) {
  const int64_t row_bytes = static_cast<int64_t>(k / Q::kBlockElems) * Q::kBlockBytes;
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

bool read_all(FILE* f, void* p, size_t n) { return std::fread(p, 1, n, f) == n; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (in == nullptr) return 2;
  int32_t head[3];
  if (!read_all(in, head, sizeof head)) return 2;
  const int qtype = head[0], rows = head[1], k = head[2];
  std::vector<double> out(rows);
  bool ok = true;
  const bool known = candle_vllm::gguf::dispatch_q8(qtype, [&](auto part) {
    using Q = decltype(part);
    const size_t wbytes = static_cast<size_t>(rows) * (k / Q::kBlockElems) * Q::kBlockBytes;
    // 16-byte aligned as the GPU tensor, and exactly its size: built with AddressSanitizer, a read past the last
    // block (the GPU's memcheck finding) fails the run.
    const Weights w(wbytes);
    std::vector<int8_t> xq(k);
    std::vector<XBlock> xb(k / 32);
    ok = w.data() != nullptr && read_all(in, w.data(), wbytes) && read_all(in, xq.data(), k) &&
         read_all(in, xb.data(), xb.size() * sizeof(XBlock));
    if (ok) dot_rows<Q>(w.data(), rows, k, xq.data(), xb.data(), out.data());
  });
  std::fclose(in);
  if (!known) return 3;
  if (!ok) return 2;
  FILE* o = std::fopen(argv[2], "wb");
  if (o == nullptr || std::fwrite(out.data(), sizeof(double), rows, o) != static_cast<size_t>(rows)) return 2;
  std::fclose(o);
  return 0;
}
