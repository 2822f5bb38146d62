// What the int8 tensor-core GGUF product's two kernels (gguf_mmq.cu: weights in flight in registers;
// gguf_mmq_staged.cu: weights streamed through shared memory) share beside the arithmetic (gguf_mmq_arith.cuh): the
// activations of a token tile, and the cross-warp reduction and store of a CTA's rows.
#pragma once
#include "cuda/common.cuh"
#include "cuda/gguf_mmq_arith.cuh"
#include "cuda/gguf_rope_epilogue.cuh"

namespace candle_vllm::cuda {
namespace {

// How a token tile's activations are loaded (PointerTokens' Ld): plain loads where the codes and XBlocks were staged
// in shared memory, else ordinary cached global loads (ld_x).
template <bool kStaged>
struct TokenLoads {
  template <typename V>
  __device__ static V ld(const void* p) {
    if constexpr (kStaged) return *static_cast<const V*>(p);
    else return gguf::ld_x<V>(p);
  }
};
template <bool kStaged>
using TokenRowsOf = PointerTokens<TokenLoads<kStaged>>;
using TokenRows = TokenRowsOf<false>;

// Token tile i's activation pointers for this lane at element e0 of K (TokenRows' layout; rows past M re-read the
// last token, whose sums the store drops).
template <class Q, int T>
__device__ __forceinline__ void token_rows(TokenRows (&x)[T], const int8_t* xq, const XBlock* xb, int M, int K,
                                          int e0, int g, int t) {
#pragma unroll
  for (int i = 0; i < T; ++i) {
    x[i].codes = xq + static_cast<int64_t>(min(8 * i + g, M - 1)) * K + e0 + (Q::kSplitLanes ? 4 : 8) * t;
#pragma unroll
    for (int k = 0; k < 2; ++k)
      x[i].blocks[k] = xb + static_cast<int64_t>(min(8 * i + 2 * t + k, M - 1)) * (K / 32) + e0 / 32;
  }
}

// The CTA's rows row0.. (16 * MT of them): the W K-splitting warps' sums meet in shared memory in warp order (so the
// result is deterministic), then y[m, row] = the sum, or with kRope the RoPE + cache store. Every one of the CTA's
// kThreads threads calls it (warps from W on hold no sums).
template <int MT, int T, int W, int kThreads, bool kRope>
__device__ __forceinline__ void store_rows(const float (&acc)[MT][T][4], void* y, bool bf16, int row0, int M, int N,
                                           const GgufRopeCache& rope) {
  constexpr int kRows = 16 * MT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  __shared__ float red[W][kRows][8 * T + 1];
  if (warp < W)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < T; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) red[warp][16 * mt + g + 8 * (k >> 1)][8 * i + 2 * t + (k & 1)] = acc[mt][i][k];
  __syncthreads();
  auto sum = [&](int r, int m) {
    float v = red[0][r][m];
#pragma unroll
    for (int i = 1; i < W; ++i) v += red[i][r][m];
    return v;
  };
  for (int o = threadIdx.x; o < kRows * 8 * T; o += kThreads) {
    const int r = o % kRows, m = o / kRows, row = row0 + r;
    if (row >= N || m >= M) continue;
    const float v = sum(r, m);
    if constexpr (kRope) {
      const float pv = sum(r ^ 1, m);  // the rotation partner (row0 and kRows are even)
      const RopeLane l = rope_lane(rope, row, m);
      if (bf16) rope_cache_store<__nv_bfloat16>(y, v, pv, l, rope, row, m, N);
      else rope_cache_store<__half>(y, v, pv, l, rope, row, m, N);
    } else {
      const int64_t at = static_cast<int64_t>(m) * N + row;
      if (bf16) static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(v);
      else static_cast<__half*>(y)[at] = __float2half_rn(v);
    }
  }
}

}  // namespace
}  // namespace candle_vllm::cuda
