// The store of the GGUF RoPE + cache epilogue (the dp4a GEMV's, gguf_gemv_q8.cu, and the tensor-core product's,
// gguf_mmq.cu): one output element of a fused q/k/v projection whose q/k rows hold each head's halves interleaved
// in pairs, rotated as the separate RoPE kernel would, written to y in the standard head layout and, for k and v,
// to the paged cache (of the activations' dtype or e4m3).
#pragma once
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/fp8_kv.cuh"
#include "cuda/gguf.h"

namespace candle_vllm::cuda {
namespace {

// The step inputs one epilogue element needs: its token's slot and, for a q/k row (as stored), its pair's cos and
// sin. The dp4a GEMV's warp 0 reads them before the block reduces its sums, so the loads' latency hides behind the
// reduction; the tensor-core product's store reads them per output after its reduction.
struct RopeLane {
  int64_t slot;
  float c, s;
};

__device__ __forceinline__ RopeLane rope_lane(const GgufRopeCache& a, int row, int m) {
  RopeLane l{a.slots[m], 0.f, 0.f};
  if (row < a.rot_rows) {
    const float* cs = a.cos_sin + a.positions[m] * a.head_dim + ((row % a.head_dim) >> 1);
    l.c = cs[0], l.s = cs[a.head_dim >> 1];
  }
  return l;
}

// One output element of the RoPE + cache epilogue: row `row` (as stored) for token m, with v its final sum and
// pv its partner row's (row ^ 1). Each sum is rounded to T first, as the GEMV's store followed by the RoPE kernel
// would round it; cos/sin too (rotary.cu), and the rotation is the shared rope_pair.
template <typename T>
__device__ __forceinline__ void rope_cache_store(void* y, float v, float pv, const RopeLane& l,
                                                 const GgufRopeCache& a, int row, int m, int N) {
  const int64_t slot = l.slot;
  const int d = a.head_dim;
  T out;
  int feat = row;
  if (row >= a.rot_rows) {  // a v feature: stored as it is
    out = from_f32<T>(v);
    const int vf = row - a.rot_rows;
    if (slot >= 0) store_cache_value(a.value_cache, (slot * a.kv_heads + vf / d) * d + vf % d, out, a.cache_e4m3);
  } else {
    const int head0 = row - row % d, p = (row % d) >> 1, half = d >> 1;
    const bool second = row & 1;
    const float2 r = rope_pair(round_to<T>(second ? pv : v), round_to<T>(second ? v : pv), round_to<T>(l.c),
                               round_to<T>(l.s));
    out = from_f32<T>(second ? r.y : r.x);
    feat = head0 + (second ? half + p : p);
    if (row >= a.q_rows && slot >= 0)
      store_cache_value(a.key_cache, (slot * a.kv_heads + (head0 - a.q_rows) / d) * d + feat - head0, out,
                        a.cache_e4m3);
  }
  static_cast<T*>(y)[static_cast<int64_t>(m) * N + feat] = out;
}

}  // namespace
}  // namespace candle_vllm::cuda
