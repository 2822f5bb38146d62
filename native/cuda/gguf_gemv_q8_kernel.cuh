// Decode GEMV against int8 activations: y[M, N] = x[M, K] @ W[N, K]^T for M <= 8, W in GGUF blocks.
//
// gguf_gemv_q8 makes two launches on the caller's stream. The first quantizes each 32-element block of x to
// int8 codes (q8_activation.cuh: scale amax / 127, IEEE division, rounding half away from zero, as the CPU
// kernels do) plus per-half code sums. gguf_gemv_q8_quantized skips it: the kernel before it (RMSNorm or
// SiLU-and-mul) already wrote the codes. The GEMV itself streams W (a programmatic dependent launch: it fetches
// its first weights while the producer of the codes runs):
// a CTA (128 threads; 64 for the K-quants) owns R weight rows and its threads walk the rows' blocks together,
// each taking one Part of a block (gguf_q8.cuh) for all R rows at once, so several independent weight loads
// are in flight per thread and each activation load serves every row. Products are integer dp4a sums scaled
// per block in f32; threads reduce by warp shuffles and one shared-memory step. No shared-memory staging: the
// int8 activations (K bytes per token) stay in L1 and are shared by all CTAs of an SM. The kernel is bound by
// its integer instruction issue (decoding), not by loads in flight: a persistent variant that staged weights
// through shared memory with cp.async several tasks ahead ran 1.4-2x slower on the H200.
//
// R is a launch choice: 2, 4 or 8 for one or two tokens, 2 or 4 from three up (rows = 0: rows_for in gguf_gemv_q8.cu). Every choice gives the same bits: each output row is summed by the same threads
// over the same slots in the same order, and reduced the same way.
//
// The RoPE + cache epilogue (gguf_gemv_q8_rope_cache) is the same kernel with another store: the q/k rows of a
// fused q/k/v weight hold each head's halves interleaved in pairs (rows i and half + i of a head adjacent, pair
// group 1 of ops/row_pairs.py), so with R even a CTA owns whole rotation pairs, and warp 0 (which holds the
// R x M final sums, R * M <= 32) swaps partners with one shuffle, rotates them as the separate RoPE kernel would,
// writes y in the standard head layout and stores k and v at the tokens' cache slots (gguf_rope_epilogue.cuh).
//
// The kernels (the host side, launch choices and entry points are in gguf_gemv_q8.cu, the only includer).
#pragma once
#include "cuda/common.cuh"
#include "cuda/gguf.h"
#include "cuda/gguf_q8.cuh"
#include "cuda/gguf_rope_epilogue.cuh"

namespace candle_vllm::cuda {
namespace {

using gguf::XBlock;

template <int T>
constexpr int type_code(const gguf::Q8Dot<T>*) {
  return T;
}

template <class Q>
constexpr int type_of() {
  return type_code(static_cast<const Q*>(nullptr));
}

// Threads per CTA: 128, but 64 for the K-quants (Q2_K..Q6_K), whose parts are a quarter block (a 4096-element row
// is 64 parts, one per thread).
template <class Q>
__host__ __device__ constexpr int cta_threads() {
  return Q::kParts == 4 ? 64 : 128;
}

// CTAs per SM the register allocation must allow (__launch_bounds__ min blocks) for one token, R = 2, 4, 8, in
// units of 128-thread CTAs (min_ctas scales them to the type's CTA size); 1 is the compiler's choice. Each is the
// bound the measured launches ran with (H200, bench_quant_cuda.py --sweep-rows; ptxas -v, sm_90a: no spills):
//   - the 32-element types (128-thread CTAs): 8 / 8 / 4, at most 64 / 64 / 128 registers, aiming at one wave for
//     N = 4096 (capping 2-row CTAs at 64 registers took q6k, then on this path, 4096x4096 from 29.7 to 37.0 % of
//     bandwidth);
//   - Q4_K/Q5_K (64-thread CTAs): 4 / 1 / 1, i.e. 8 CTAs at R = 2 (at most 128 registers), the compiler's
//     120-123 / 208-217 registers at R = 4 / 8 (8 and 4 CTAs per SM);
//   - Q6_K: Q4_K's 4 / 1 / 1 since its codes stay 0..63 (the -32 from the code sums: R = 2 no longer fits 64
//     registers, spilling 104 bytes; it ran 8 / 1 / 1 before; R = 4, its default, keeps the compiler's choice, and
//     R = 2 under the new bound is not measured);
//   - Q2_K/Q3_K (64-thread CTAs, not yet measured): Q4_K's 4 / 1 / 1 (64 registers at R = 2 spilled 44-108
//     bytes), 87-90 / 128-141 / 244-248 registers at R = 2 / 4 / 8.
// Several tokens: the 32-element types ask for 4 CTAs (at most 128 registers). The compiler hoists every token's
// activation loads for all R rows (q4_0 at 4 tokens x 4 rows took 168 registers: 3 CTAs, 12 warps per SM); capped
// at 128 they spill nothing, and the several-token sweep (session 33, bench_quant_cuda.py --sweep-rows --m 2 4 8
// --codes, caps 64 / 96 / 128 against none, us summed over the four 8B shapes at the default rows) ran q4_0 at 8
// tokens 122.8 -> 96.6, q4_1 122.3 -> 93.9, q5_0 108.0 -> 97.0, q5_1 109.3 -> 95.3, q8_0 119.1 -> 108.4; at 4
// tokens 4-13 % faster, and within 1.5 % of the best cap (96) where another won. The K-quants keep the compiler's
// choice (every cap lost or tied at 2-8 tokens), but Q6_K at two tokens and R = 2 asks for 9 CTAs of 64 threads:
// the compiler's 122 registers there (106 with centred codes) left 8, and batch-2 decode ran 1.9 % slower; with 9
// (96 registers, no spill) it is within 1 % (session 17, calls 1 and 2).
constexpr int kSeveralTokenCtas = 4;
constexpr int kQ6KTwoTokenCtas = 9;
struct OneTokenBounds {
  int r2, r4, r8;
};

constexpr OneTokenBounds one_token_bounds(int type) {
  switch (type) {
    case gguf::Q4_K:
    case gguf::Q5_K:
    case gguf::Q2_K:
    case gguf::Q3_K:
    case gguf::Q6_K: return {4, 1, 1};
    default: return {8, 8, 4};  // the 32-element types
  }
}

template <class Q, int M, int R>
constexpr int min_ctas() {
  if (M == 2 && R == 2 && type_of<Q>() == gguf::Q6_K) return kQ6KTwoTokenCtas;
  if (M != 1) return cta_threads<Q>() == 128 ? kSeveralTokenCtas : 1;
  const OneTokenBounds b = one_token_bounds(type_of<Q>());
  return (R == 2 ? b.r2 : R == 4 ? b.r4 : b.r8) * 128 / cta_threads<Q>();
}

// Four threads per 32-element block, eight elements each (a warp holds a 256-value run: G = 32 or 256).
template <typename T, int G>
__global__ void __launch_bounds__(256) quantize_x_kernel(const T* x, int8_t* __restrict__ xq,
                                                        XBlock* __restrict__ xb, int64_t vectors) {
  // The GEMV may start now: it streams its first weights while this grid runs and waits before reading xq.
  pdl_launch_dependents();
  pdl_wait();  // x is the output of the kernel before (a programmatic dependent launch too)
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool live = i < vectors;
  Vec<T, 8> in;
  if (live) in = *reinterpret_cast<const Vec<T, 8>*>(x + 8 * i);
  q8_store_vec<G>(in, live, xq, xb, 8 * i);
}

// How a thread walks its slots (the bits are the same for all three: each row's sums keep their order).
//   kDecodeAll: fetch and decode the slot for all R rows, then multiply: R decoded parts are live at once.
//   kPipelined (Q4_K, one token, rows longer than one pass of the CTA's threads): each pass fetches the next
//     pass's weights before it decodes and multiplies its own, so a thread always has a pass of loads in flight
//     (twice the raw registers; the compiler's register choice). Measured on the H200 (4096x14336, 8 rows per
//     CTA): q4k 12.10 vs 12.38 us, batch-1 decode 451.4 / 452.6 vs 449.3 / 450.0 tok/s; the other types lost
//     (q8_0 20.1 vs 19.2 us, q4_0 13.0 vs 11.3, q6k 27.8 vs 21.5: the extra registers cost them more occupancy
//     than the overlap gives).
//   kRowByRow (Q2_K at one and two tokens; Q4_0 and Q4_1 at two tokens and R = 8, below): fetch all R rows' raw
//     words, then decode and multiply one row at a time, so one decoded part is live instead of R. Q2_K's raw
//     slot (7 words) is far smaller than its decoded one (24): ptxas, sm_90a: R = 8 246 -> 179 registers, R = 4
//     139 -> 109. Q6_K and Q3_K (then 2-byte aligned blocks, fetched as aligned words plus a tail; their CUDA
//     layouts are aligned since sessions 28 and 29) took more (R = 4: 128 -> 230, 128 -> 214) and ran 18-45 %
//     slower; Q5_K up to 27 % slower, Q4_K even to 6 % slower (H200, session 27 in benches/RESULTS.md).
//     Q4_0/Q4_1 at two tokens and R = 8 too: the decode-all loop spilled 112 / 152 bytes under the several-token
//     bound of 128 registers, row by row spills none (H100, session 49: 4096x4096 5.53 / 5.26 against 6.65 / 6.72
//     us, 28672x4096 27.07 / 27.50 against 35.87 / 38.51). Q2_K's two-token 8-row launch as well (254 registers
//     and no spill against 255 and 16 bytes; H100, session 50, us row by row / decode-all: 4096x4096 4.98 / 5.81,
//     4096x14336 12.53 / 14.88, 28672x4096 24.39 / 27.44; batch-2 decode 798.1 / 786.1 against 753.1 / 757.7 tok/s),
//     and its other two-token launches (R = 4: 153 against 168 registers; 6144x4096 7.06 against 7.64 us, batch-2
//     decode 791.6 / 799.9 against 788.5 / 786.4 tok/s). From 3 tokens it gains nothing (Q2_K takes the tensor-core
//     product there; at 8 tokens and R = 4 it spills), nor do the 32-element types at 4 tokens (registers even;
//     batch-4 q4_0 decode 1,271.9 / 1,280.8 against 1,296.9 / 1,290.0 tok/s).
enum class Loop { kDecodeAll, kPipelined, kRowByRow };

template <class Q, int M, int R, bool ROPE, Loop LOOP = Loop::kDecodeAll>
__global__ void __launch_bounds__(cta_threads<Q>(), (LOOP == Loop::kPipelined ? 1 : min_ctas<Q, M, R>()))
    gemv_q8_kernel(void* __restrict__ y, bool bf16, const int8_t* __restrict__ xq, const XBlock* __restrict__ xb,
                   const uint8_t* __restrict__ w, int rows_m, int N, int K, int64_t row_bytes,
                   const GgufRopeCache rope) {
  // The one-token kernels of the latency-bound types trigger the next grid at entry (see pdl_wait in common.cuh):
  // its CTAs take the SM room this grid's last wave leaves and run their prologue while it streams. Of the
  // two-token kernels only Q6_K's (H100, session 51, batch-2 decode, four rounds: 613.1 / 611.6 / 612.8 / 612.6
  // against 608.6 / 609.9 / 608.7 / 608.1 tok/s, +0.6 %). The others lose though their narrow kernels gain 7-23 % in a
  // chain of their own kind: q4_0 -2.0 %, q2k -2.0 %, q3k -0.6 %, q5_1 -0.5 %.
  constexpr bool kTriggerAtEntry = (M == 1 && type_of<Q>() != gguf::Q8_0) || (M == 2 && type_of<Q>() == gguf::Q6_K);
  if constexpr (kTriggerAtEntry) pdl_launch_dependents();
  using Raw = typename Q::Raw;
  constexpr int kThreads = cta_threads<Q>();
  const int row0 = blockIdx.x * R;
  const int slots = K / Q::kBlockElems * Q::kParts;
  // Q8_0 rows are taken as 16-byte aligned (they are: gguf::rows_aligned16), so the compiler finds a grouped block's
  // slot once for all R rows and folds the rows' address arithmetic (one-token loop at 4 rows: 150 -> 118 SASS
  // instructions). H200, two A/B calls (session 30, benches/RESULTS.md): -0.4 to -3.9 % in every cell at 2-8
  // tokens, -7.1 to +1.7 % at one token. The other aligned types did not gain beyond the spread: Q4_K and Q5_K at
  // one token -1.9 / -2.8 % in one call, Q4_K +2.1 % in the other; Q6_K and Q3_K lost 8-34 % at one token
  // (registers 128 -> 156 / 148), and with the registers capped at 128 were even to 5 % slower; Q5_0 even.
  constexpr bool kAlignedRows = type_of<Q>() == gguf::Q8_0;
  static_assert(!kAlignedRows || gguf::rows_aligned16(type_of<Q>()));
  const uint8_t* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    wr[r] = w + static_cast<int64_t>(min(row0 + r, N - 1)) * row_bytes;
    if constexpr (kAlignedRows) wr[r] = static_cast<const uint8_t*>(__builtin_assume_aligned(wr[r], 16));
  }
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

  auto block = [&](int r, int s) { return wr[r] + static_cast<int64_t>(s / Q::kParts) * Q::kBlockBytes; };
  auto load_x = [&](typename Q::X& xv, int m, int s) {
    const int t = min(m, rows_m - 1);  // rows past M re-read the last one; their sums are dropped
    const int b = s / Q::kParts;
    Q::load_x(xv, xq + static_cast<int64_t>(t) * K + b * Q::kBlockElems,
              xb + static_cast<int64_t>(t) * (K / 32) + b * (Q::kBlockElems / 32), s % Q::kParts);
  };
  auto dot = [&](const Q (&part)[R], int s) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      typename Q::X xv;
      load_x(xv, m, s);
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][m] += part[r].dot(xv);
    }
  };
  // The first weights do not depend on the kernel before, which writes xq/xb (the quantizer, or the RMSNorm /
  // SiLU that wrote them as it produced x): fetch them, then wait for its grid. Load -> use -> load: the decoded
  // slot is what stays live across the loop (fewer registers than its words).
  Q part[R];
  auto load = [&](int s) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      Raw raw;
      Q::fetch(raw, block(r, s), s % Q::kParts);
      part[r].decode(raw, block(r, s), s % Q::kParts);
    }
  };
  auto fetch_rows = [&](Raw (&raw)[R], int s) {  // every row's raw words of slot s
#pragma unroll
    for (int r = 0; r < R; ++r) Q::fetch(raw[r], block(r, s), s % Q::kParts);
  };
  if constexpr (LOOP == Loop::kRowByRow) {
    Raw raw[R];
    if (threadIdx.x < slots) fetch_rows(raw, threadIdx.x);
    pdl_wait();
    for (int s = threadIdx.x; s < slots; s += kThreads) {
      if (s != threadIdx.x) fetch_rows(raw, s);
      typename Q::X xv[M];
#pragma unroll
      for (int m = 0; m < M; ++m) load_x(xv[m], m, s);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        Q one;
        one.decode(raw[r], block(r, s), s % Q::kParts);
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] += one.dot(xv[m]);
      }
    }
  } else if constexpr (LOOP == Loop::kPipelined) {
    Raw next[R];
    if (threadIdx.x < slots) fetch_rows(next, threadIdx.x);
    pdl_wait();
    for (int s = threadIdx.x; s < slots; s += kThreads) {
      Raw cur[R];
#pragma unroll
      for (int r = 0; r < R; ++r) cur[r] = next[r];
      if (s + kThreads < slots) fetch_rows(next, s + kThreads);
#pragma unroll
      for (int r = 0; r < R; ++r) part[r].decode(cur[r], block(r, s), s % Q::kParts);
      dot(part, s);
    }
  } else {
    if (threadIdx.x < slots) load(threadIdx.x);
    pdl_wait();
    for (int s = threadIdx.x; s < slots; s += kThreads) {
      if (s != threadIdx.x) load(s);
      dot(part, s);
    }
  }

  if constexpr (!kTriggerAtEntry) pdl_launch_dependents();  // the next kernel's prologue overlaps the reduction
  RopeLane in{-1, 0.f, 0.f};
  if constexpr (ROPE) {
    if (threadIdx.x < R * M)  // warp 0's epilogue lanes (rows and tokens past the end read the last ones)
      in = rope_lane(rope, min(row0 + static_cast<int>(threadIdx.x) / M, N - 1),
                     min(static_cast<int>(threadIdx.x) % M, rows_m - 1));
  }
  __shared__ float red[kThreads / 32][R * M];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = warp_sum(acc[r][m]);
      if (lane == 0) red[warp][r * M + m] = v;
    }
  __syncthreads();
  if constexpr (ROPE) {
    static_assert(R % 2 == 0 && R * M <= 32 && (M & (M - 1)) == 0, "warp 0 holds whole pairs of rows");
    if (warp != 0) return;
    float v = 0.f;
    if (lane < R * M)
#pragma unroll
      for (int i = 0; i < kThreads / 32; ++i) v += red[i][lane];
    const float pv = __shfl_xor_sync(0xffffffffu, v, M);  // lane (r ^ 1) * M + m: the partner row, same token
    const int r = lane / M, m = lane % M, row = row0 + r;
    if (lane < R * M && row < N && m < rows_m) {
      if (bf16) rope_cache_store<__nv_bfloat16>(y, v, pv, in, rope, row, m, N);
      else rope_cache_store<__half>(y, v, pv, in, rope, row, m, N);
    }
  } else if (threadIdx.x < R * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M, row = row0 + r;
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) v += red[i][threadIdx.x];
    if (row < N && m < rows_m) {
      const int64_t at = static_cast<int64_t>(m) * N + row;
      if (bf16) static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(v);
      else static_cast<__half*>(y)[at] = __float2half_rn(v);
    }
  }
}

}  // namespace
}  // namespace candle_vllm::cuda
