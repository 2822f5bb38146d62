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
// kThreads threads calls it (warps from W on hold no sums). The warps' sums pass through shared memory 8 warps at a
// time, each output's fold kept in a register between passes (the same order as one pass): 16 warps of 32 rows x 32
// tokens would take 67 KB, past the 48 KB of static shared memory a kernel may have.
template <int MT, int T, int W, int kThreads, bool kRope>
__device__ __forceinline__ void store_rows(const float (&acc)[MT][T][4], void* y, bool bf16, int row0, int M, int N,
                                           const GgufRopeCache& rope) {
  constexpr int kRows = 16 * MT, kOuts = kRows * 8 * T, kPerThread = (kOuts + kThreads - 1) / kThreads;
  constexpr int kPass = W < 8 ? W : 8;
  static_assert(W % kPass == 0 && kThreads % 2 == 0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  __shared__ float red[kPass][kRows][8 * T + 1];
  float sum[kPerThread] = {};
#pragma unroll
  for (int w0 = 0; w0 < W; w0 += kPass) {
    if (w0 > 0) __syncthreads();  // the last pass's reads are done
    if (warp >= w0 && warp < w0 + kPass)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < T; ++i)
#pragma unroll
          for (int k = 0; k < 4; ++k)
            red[warp - w0][16 * mt + g + 8 * (k >> 1)][8 * i + 2 * t + (k & 1)] = acc[mt][i][k];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int o = threadIdx.x + j * kThreads;
      if (o >= kOuts) continue;
      const int r = o % kRows, m = o / kRows;
      float v = w0 == 0 ? red[0][r][m] : sum[j] + red[0][r][m];
#pragma unroll
      for (int i = 1; i < kPass; ++i) v += red[i][r][m];
      sum[j] = v;
    }
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int o = threadIdx.x + j * kThreads, r = o % kRows, m = o / kRows, row = row0 + r;
    if constexpr (kRope) {
      // The rotation partner (row0 and kRows are even): output o ^ 1, the neighbouring lane's, since kThreads is even.
      const float partner = __shfl_xor_sync(0xffffffffu, sum[j], 1);
      if (o >= kOuts || row >= N || m >= M) continue;
      const RopeLane l = rope_lane(rope, row, m);
      if (bf16) rope_cache_store<__nv_bfloat16>(y, sum[j], partner, l, rope, row, m, N);
      else rope_cache_store<__half>(y, sum[j], partner, l, rope, row, m, N);
    } else {
      if (o >= kOuts || row >= N || m >= M) continue;
      const int64_t at = static_cast<int64_t>(m) * N + row;
      if (bf16) static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(sum[j]);
      else static_cast<__half*>(y)[at] = __float2half_rn(sum[j]);
    }
  }
}

}  // namespace
}  // namespace candle_vllm::cuda
