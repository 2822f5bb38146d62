// Host driver for the arithmetic of the int8 tensor-core GGUF product (native/cuda/gguf_mmq_arith.cuh): one warp's
// lanes as 32 threads, its mma.sync emulated from the PTX fragment layouts (host_warp_mma below), walking every
// unit of every row tile through the tile loaders and multiply_unit / multiply_unit_k as a warp of the kernels does
// (here one warp takes all of K), for each launch shape in kShapes: the m-tiles and token tiles change which of the
// product's code paths a unit takes, and every one must give the same sums.
//
//   mma_rows IN OUT   IN: int32 qtype, rows, K; rows * row_bytes weight bytes (the CUDA layout); int32 M; M * K int8
//                         codes; M * K / 32 XBlocks (q8_activation.cuh: the K-quants' d the same over each 256)
//                     OUT: for each of kShapes, M * rows f64 (token-major: the product's f32 sums)
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "driver.h"

// One warp's lanes in lock step at each mma: every lane leaves its fragments, waits for all 32, computes its own C
// words from all of them, and waits again before the fragments are reused.
class WarpBarrier {
 public:
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const unsigned generation = generation_;
    if (++arrived_ == 32) {
      arrived_ = 0, ++generation_;
      changed_.notify_all();
    } else {
      changed_.wait(lock, [&] { return generation_ != generation; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  unsigned generation_ = 0;
};

struct Warp {
  WarpBarrier barrier;
  uint32_t a[32][4], b[32][2];
};
inline Warp* the_warp = nullptr;
inline thread_local int the_lane = 0;

// mma.sync.aligned.m16n8kK.row.col.s32.{u8,s8}.s8.s32 (PTX ISA, "Matrix Fragments for mma.m16n8k16 / m16n8k32" with
// .s8/.u8): lane l = 4 * groupID + threadID_in_group. A (16 x K): word 2 * (k / 16) + row / 8 of lane
// 4 * (row % 8) + (k % 16) / 4, byte k % 4. B (K x 8): word k / 16 of lane 4 * col + (k % 16) / 4, byte k % 4.
// C: c0, c1 row groupID, columns 2 * threadID_in_group + {0, 1}; c2, c3 row groupID + 8.
template <int K, bool kUnsignedA>
void host_warp_mma(int (&c)[4], const uint32_t* a, const uint32_t* b) {
  Warp& w = *the_warp;
  for (int i = 0; i < K / 8; ++i) w.a[the_lane][i] = a[i];
  for (int i = 0; i < K / 16; ++i) w.b[the_lane][i] = b[i];
  w.barrier.wait();
  auto byte = [](uint32_t word, int k) { return (word >> (8 * (k % 4))) & 0xFF; };
  const int g = the_lane >> 2, t = the_lane & 3;
  int out[4];
  for (int o = 0; o < 4; ++o) {
    const int row = g + 8 * (o >> 1), col = 2 * t + (o & 1);
    uint32_t sum = static_cast<uint32_t>(c[o]);  // s32 accumulation wraps as the hardware's does
    for (int k = 0; k < K; ++k) {
      const uint32_t av = byte(w.a[4 * (row % 8) + (k % 16) / 4][2 * (k / 16) + row / 8], k);
      const int x = static_cast<int8_t>(byte(w.b[4 * col + (k % 16) / 4][k / 16], k));
      sum += static_cast<uint32_t>((kUnsignedA ? static_cast<int>(av) : static_cast<int8_t>(av)) * x);
    }
    out[o] = static_cast<int>(sum);
  }
  w.barrier.wait();
  for (int o = 0; o < 4; ++o) c[o] = out[o];
}

#include "cuda/gguf_mmq_arith.cuh"

namespace cv = candle_vllm::cuda;
namespace gguf = candle_vllm::gguf;
namespace mmq = candle_vllm::cuda::mmq;

namespace {

// Loads of a token tile's activations (PointerTokens' Ld) by memcpy.
struct HostLoads {
  template <typename V>
  static V ld(const void* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
};
using HostTokens = cv::PointerTokens<HostLoads>;

struct Shape {
  int m_tiles, token_tiles;
  bool split_low, held;  // held: the tokens taken through UnitTokens (the staged kernel's held tokens)
};
// (1, 1) and (2, 1) take the u8 / offset-code paths and the min mmas; (1, 2) and (2, 2) too where MT * T <= 2, the
// shifted / centered codes where not; (2, 4) the min terms by dp2a; split_low the second min chain; the last three the
// shapes the staged kernel multiplies from held tokens.
constexpr Shape kShapes[] = {{1, 1, false, false}, {1, 1, true, false}, {2, 1, false, false},
                             {1, 2, false, false}, {2, 2, false, false}, {2, 4, false, false},
                             {1, 1, false, true},  {1, 1, true, true},   {2, 1, false, true}};

struct Problem {
  const uint8_t* w;
  int64_t row_bytes;
  int rows, k, m;
  const int8_t* xq;
  const gguf::XBlock* xb;
};

// One row tile (rows row0 .. row0 + 16 * MT, those past the last repeating it as the kernels' copies do) through all
// of K; the sums of real rows and tokens go to y[token * rows + row].
template <class Q, int MT, int T, bool kSplitLow, bool kHeld>
void row_tile(const Problem& p, int row0, double* y) {
  Warp warp;
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < 32; ++lane)
    lanes.emplace_back([&p, row0, y, lane, &warp] {
      the_warp = &warp, the_lane = lane;
      const int g = lane >> 2, t = lane & 3;
      float acc[MT][T][4] = {};
      for (int u = 0; u < p.k / Q::kBlockElems; ++u) {
        Q q[MT][2];
        for (int mt = 0; mt < MT; ++mt)
          for (int r = 0; r < 2; ++r) {
            const int row = std::min(row0 + 16 * mt + 8 * r + g, p.rows - 1);
            q[mt][r].fetch(p.w + row * p.row_bytes, u, t);
          }
        HostTokens x[T];
        const int e0 = u * Q::kBlockElems;
        for (int i = 0; i < T; ++i) {
          x[i].codes = p.xq + std::min(8 * i + g, p.m - 1) * p.k + e0 + (Q::kSplitLanes ? 4 : 8) * t;
          for (int k = 0; k < 2; ++k)
            x[i].blocks[k] = p.xb + std::min(8 * i + 2 * t + k, p.m - 1) * (p.k / 32) + e0 / 32;
        }
        if constexpr (kHeld) {
          cv::UnitTokens<Q> held[T];
          for (int i = 0; i < T; ++i) held[i].load(x[i]);
          cv::multiply_any<Q, MT, T, kSplitLow>(q, t, held, acc);
        } else {
          cv::multiply_any<Q, MT, T, kSplitLow>(q, t, x, acc);
        }
      }
      for (int mt = 0; mt < MT; ++mt)
        for (int i = 0; i < T; ++i)
          for (int o = 0; o < 4; ++o) {
            const int row = row0 + 16 * mt + g + 8 * (o >> 1), token = 8 * i + 2 * t + (o & 1);
            if (row < p.rows && token < p.m) y[token * p.rows + row] = acc[mt][i][o] * mmq::kOutputScale<Q>;
          }
    });
  for (std::thread& lane : lanes) lane.join();
}

template <class Q, int S>
void shape_rows(const Problem& p, double* y) {
  constexpr Shape kShape = kShapes[S];
  for (int row0 = 0; row0 < p.rows; row0 += 16 * kShape.m_tiles)
    row_tile<Q, kShape.m_tiles, kShape.token_tiles, kShape.split_low, kShape.held>(p, row0, y);
}

template <class Q, int... S>
void every_shape(const Problem& p, double* y, std::integer_sequence<int, S...>) {
  (shape_rows<Q, S>(p, y + S * p.m * p.rows), ...);
}

}  // namespace

int main(int argc, char** argv) {
  return driver_main<double>(argc, argv, [](const Header& h, FILE* in, std::vector<double>& out, bool& ok) {
    return mmq::dispatch(h.qtype, [&](auto loader) {
      using Q = decltype(loader);
      const int64_t row_bytes = gguf::row_bytes(h.qtype, h.k);
      const Weights w(in, static_cast<size_t>(h.rows) * row_bytes);
      int32_t m = 0;
      ok = w.ok() && read_all(in, &m, sizeof m) && m > 0 && h.k % 256 == 0;
      if (!ok) return;
      std::vector<int8_t> xq(static_cast<size_t>(m) * h.k);
      std::vector<gguf::XBlock> xb(static_cast<size_t>(m) * h.k / 32);
      ok = read_all(in, xq.data(), xq.size()) && read_all(in, xb.data(), xb.size() * sizeof(gguf::XBlock));
      if (!ok) return;
      constexpr int kCount = sizeof kShapes / sizeof kShapes[0];
      out.assign(static_cast<size_t>(kCount) * m * h.rows, 0.0);
      const Problem p{w.data(), row_bytes, h.rows, h.k, m, xq.data(), xb.data()};
      every_shape<Q>(p, out.data(), std::make_integer_sequence<int, kCount>{});
    });
  });
}
