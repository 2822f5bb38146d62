// Batched decode product on int8 tensor cores for GGUF weights: y[M, N] = x[M, K] @ W[N, K]^T for
// up to 32 tokens, x given as the int8 codes and XBlocks of q8_activation.cuh (one scale per 32 values, as the dp4a
// GEMV takes them, or per 256 for the K-quants).
//
// Why: the dp4a GEMV decodes every weight once per token, so its integer work grows with M and from about 8 tokens
// it is bound by instruction issue, far below the memory bandwidth. Here a weight is decoded once for all tokens:
// a warp unpacks a 16-row x 32-column tile of codes into the A fragment of mma.m16n8k32 (s8 x s8 -> s32) and
// multiplies it with up to four 8-token B fragments. The tensor cores give each (row, token, 32-element
// sub-block) the exact integer dot product of the codes. For the 32-element types (activations scaled per 32 values,
// the dp4a GEMV's codes) it is added to the f32 sum as two FMAs, (a * dx) * dot and -b * (dx * sum(x codes)), w = a *
// code - b being the sub-block's weights (the dp4a GEMV rounds dx * (a * dot - b * sum): same value, other
// roundings). The K-quants' weights are d * sc * code - dmin * m with integer scales and mins per sub-block (or per
// 16-element half: Q2_K, Q3_K, Q6_K), so with activations scaled per 256 values (one dx per unit) a unit's scaled
// dots and min terms add up in int32 and meet the floats once per unit: far fewer instructions per weight, the
// activations rounded as the CPU path and llama.cpp's CPU kernels round them for these types.
//
// Types: every block type the GGUF kernels decode (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K), each through its tile
// loader (gguf_mmq_tile.cuh). A CTA owns 16 or 32 weight rows (one or two 16-row tiles per warp: an activation load
// then serves 32 rows) and its 4, 8 or 16 warps split K by the loader's units (a Q4_K/Q5_K block, half a Q2_K/Q3_K/Q6_K
// block, two blocks of a 32-element type; warp w takes units w, w + W, ...), each keeping the next units' weights in
// flight in registers while it multiplies one (the first before griddepcontrol.wait: weights do not depend on the
// kernel before); partial sums meet in shared memory and warp order is fixed, so results are deterministic and a
// token's result does not depend on the other tokens or on the row tiling (the warp count sets the summation order;
// this kernel's rule depends on N and the device only). Batches of up to 8 tokens on Hopper take gguf_mmq_staged.cu's
// kernel instead (launch_gguf_mmq), which streams the weights through shared memory and gives the same bits with the
// same warps (its rule, staged_warps, gives some types 16). The arithmetic both kernels share is in
// gguf_mmq_multiply.cuh.
//
// The k order inside an mma is free as long as A and B agree: lane t of a quad (threadID_in_group) holds k slots
// 4t..4t+3 and 16+4t..16+4t+3. Where a type's codes are bytes in element order (Q8_0, Q4_K, Q5_K) they are given the
// sub-block's elements 8t..8t+7, so every lane reads 8 contiguous code bytes of its row and 8 contiguous activation
// codes of its token; the 32-element nibble types, whose byte i holds elements i and 16 + i, and the K-quants with a
// scale per 16 elements (Q2_K, Q3_K, Q6_K: one k16 mma per half) keep the slots' own elements (the loader's
// kSplitLanes: a lane's code bytes are two words, one in each half).

#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/gguf_mmq.h"
#include "cuda/gguf_mmq_multiply.cuh"
#include "cuda/gguf_mmq_staged.h"

namespace candle_vllm::cuda {
namespace {

// A CTA owns 16 * MT weight rows (MT m-tiles per warp, so each activation load serves 16 * MT rows); its W warps split
// K by the loader's units (warp w takes units w, w + W, ...), each keeping the loader's kDepth units in flight in a
// ring of registers while it multiplies one more: a slot is copied out, refilled with the unit kDepth steps ahead,
// then multiplied. T: 8-token tiles.
// kRope: the store is the RoPE + cache epilogue of gguf_rope_epilogue.cuh (a fused q/k/v weight whose q/k heads
// hold their halves in adjacent row pairs, so a CTA's even number of rows holds whole rotation pairs).
template <class Q, int MT, int T, int W, bool kRope>
__global__ void __launch_bounds__(W * 32) gguf_mmq_kernel(void* __restrict__ y, bool bf16, const int8_t* xq,
                                                          const XBlock* xb, const uint8_t* __restrict__ w, int M,
                                                          int N, int K, int64_t row_bytes, const GgufRopeCache rope) {
  constexpr int kRows = 16 * MT, kDepth = Q::kDepth, kStride = W * kDepth;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * kRows, units = K / Q::kBlockElems;
  const uint8_t* rows[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      rows[mt][r] = w + static_cast<int64_t>(min(row0 + 16 * mt + g + 8 * r, N - 1)) * row_bytes;
  TokenRows x[T];  // at warp's first unit
  token_rows<Q>(x, xq, xb, M, K, warp * Q::kBlockElems, g, t);
  float acc[MT][T][4] = {};

  Q ring[kDepth][MT][2];
  auto fetch = [&](Q (&slot)[MT][2], int u) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) slot[mt][r].fetch(rows[mt][r], u, t);
  };
  // The first kDepth units before griddepcontrol.wait: weights do not depend on the kernel before.
#pragma unroll
  for (int s = 0; s < kDepth; ++s)
    if (warp + s * W < units) fetch(ring[s], warp + s * W);
  pdl_wait();  // xq/xb are written by the kernel before
  for (int base = warp; base < units; base += kStride) {
#pragma unroll
    for (int s = 0; s < kDepth; ++s) {
      const int u = base + s * W;
      if (u < units) {
        Q cur[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) cur[mt][0] = ring[s][mt][0], cur[mt][1] = ring[s][mt][1];
        if (u + kStride < units) fetch(ring[s], u + kStride);
        multiply_any<Q, MT, T, false>(cur, t, x, acc);
#pragma unroll
        for (int i = 0; i < T; ++i) x[i].advance(W * Q::kBlockElems);
      }
    }
  }
  pdl_launch_dependents();

  scale_output<Q>(acc);
  store_rows<MT, T, W, W * 32, kRope>(acc, y, bf16, row0, M, N, rope);
}

template <class Q, int MT, int T, int W>
void launch_tiles(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
                  const GgufRopeCache* rope, cudaStream_t s) {
  const int64_t row_bytes = mmq::loader_row_bytes<Q>(K);
  const dim3 grid(static_cast<unsigned>((N + 16 * MT - 1) / (16 * MT))), block(W * 32);
  if (rope != nullptr)
    launch_pdl("gguf_mmq_rope_cache", gguf_mmq_kernel<Q, MT, T, W, true>, grid, block, 0, s, y, bf16, xq, xb, w, M,
               N, K, row_bytes, *rope);
  else
    launch_pdl("gguf_mmq", gguf_mmq_kernel<Q, MT, T, W, false>, grid, block, 0, s, y, bf16, xq, xb, w, M, N, K,
               row_bytes, GgufRopeCache{});
}

template <class Q, int MT, int W>
void launch_tokens(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
                   const GgufRopeCache* rope, cudaStream_t s) {
  if (M <= 8) launch_tiles<Q, MT, 1, W>(y, bf16, xq, xb, w, M, N, K, rope, s);
  else if (M <= 16) launch_tiles<Q, MT, 2, W>(y, bf16, xq, xb, w, M, N, K, rope, s);
  else launch_tiles<Q, MT, 4, W>(y, bf16, xq, xb, w, M, N, K, rope, s);
}

// Launch rules, measured on the H200 (bench_quant_cuda.py --kernels mmq --mmq-row-tiles 1 2 --mmq-warps 4 8, 8-32
// tokens, the four Llama-3-8B shapes, every type; us for q4k at 16 tokens, 6144x4096 / 4096x4096 / 28672x4096 /
// 4096x14336):
//  - two row tiles per CTA (an activation load serves 32 rows): 1x4 17.3 / 15.6 / 76.3 / 50.3 against 2x4 16.1 /
//    14.8 / 57.4 / 43.0; one tile won only q8_0 6144x4096 at 16 tokens (25.8 against 27.8).
//  - 8 warps splitting K where the grid has fewer CTAs than the device has SMs (N = 4096: 128 CTAs, so 4 warps left
//    one warp per scheduler waiting on memory): 2x8 17.3 / 10.1 / 59.1 / 27.6. 4096x14336 at 8 tokens: q4k 32.3 ->
//    22.9, q8_0 60.5 -> 40.0 us. Elsewhere 4 warps (6144x4096 at 8 tokens: 12.8 against 14.7).
// The warps split K, so they set the f32 summation order: the rule depends on N and the device's SM count only, so
// a token's result does not depend on how many tokens share the register kernel's launch (it may differ between GPU
// models).
constexpr int kWideRows = 16384;  // a grid of 16-row CTAs this tall is many waves deep
int default_warps(int N) { return (N + 31) / 32 < device_sm_count() ? 8 : 4; }

// The staged kernel (batches of up to 8 tokens on Hopper) takes 16 warps where they measured faster (H100, session
// 55: bench_quant_cuda.py --kernels mmq --m 2 4 8 --mmq-warps 0 16 --codes, us at 8 tokens, default_warps -> 16, back
// to back / behind the RMSNorm that writes the codes): where default_warps gives 8, q8_0 4096x4096 10.13 -> 8.33 /
// 8.39 -> 9.40 and 4096x14336 29.35 -> 26.52 / 29.21 -> 26.68, q4_0 4096x4096 7.35 -> 6.41 / 8.81 -> 8.01, q2k
// 4096x14336 16.12 -> 15.24 / 23.60 -> 14.42, q3k 19.01 -> 17.41 / 18.73 -> 17.85; where it gives 4 (6144x4096), q4_0
// 11.82 -> 9.05 / 11.70 -> 8.68, q5_0 11.68 -> 10.87 / 11.14 -> 10.49, q8_0 12.80 -> 11.71 / 12.64 -> 12.22. The
// half-block K-quants lose on 6144x4096 (q3k +13 / +10 %), every type but q5_1 and q4_1 on the wide weights, Q4_K,
// Q5_K and Q6_K everywhere (+18..+41 %: a chunk of 16 units holds a whole 4096-element Q4_K row), Q4_0 and Q4_1's
// long rows, which stage their tokens, +8 / +6 %. Batch-8 decode against default_warps (session 55, call 3): q8_0
// +2.1 %, q4_0 +3.0 %, q5_0 +1.3 %, q2k +2.2 %; batch-4 q3k +1.0 %. The register kernel keeps default_warps: with 16
// warps (one row tile; two spill) batch-16 decode ran q8_0 -11 % and q4_0 -3.7 %. So for these types a batch of 1-8
// tokens and one of 9-32 sum a token in another order, as batches below and above ops/quant.py's MMQ_MIN_ROWS do.
int staged_warps(int qtype, int N, int K) {
  const int warps = default_warps(N);
  if (N >= kWideRows) return warps;
  const bool long_rows = K >= 8192, few_ctas = warps == 8;
  switch (qtype) {
    case gguf::Q8_0: return 16;
    case gguf::Q4_0:
    case gguf::Q4_1: return long_rows ? warps : 16;
    case gguf::Q5_0: return long_rows || few_ctas ? warps : 16;
    case gguf::Q2_K:
    case gguf::Q3_K: return few_ctas ? 16 : warps;
    default: return warps;
  }
}

// The warps of a launch that leaves them to the rules: the staged kernel's or the register kernel's.
int rule_warps(int qtype, int N, int K, bool staged) { return staged ? staged_warps(qtype, N, K) : default_warps(N); }

// Row tiles change only the speed (each row's sums are the same), so their rule may depend on the tokens and the
// shape. On the K-quant product (session 13, call 8: --mmq-row-tiles 1 2 --m 2 4 8 16; us one / two tiles, narrow =
// 6144x4096 + 4096x4096 + 4096x14336 summed, wide = 28672x4096) one tile is faster for few tokens: on wide weights
// up to 4 (q4k 27.9 / 29.6, q3k 44.9 / 47.4; q6k 53.5 / 53.0 and q2k 30.5 / 29.7 even; 8: q6k 61.5 / 54.8, q2k
// 37.3 / 30.5), on narrow ones up to 4 for Q4_K (8: 32.7 / 31.5), 8 for Q5_K and Q2_K (q5k 37.6 / 38.6, q2k 41.5 /
// 43.8; 16: 52.9 / 44.4, 57.3 / 52.2) and 16 for Q3_K and Q6_K (60.8 / 64.2, 67.8 / 69.3); the 32-element types keep
// two (q4_0 16: 196.9 / 154.6 in call 1; below 9 tokens they take the dp4a GEMV). Wide Q4_K weights take one tile at
// 5-8 and 17-32 tokens too, where the two-tile kernels hold more registers (the 4-token-tile one spills 120 bytes):
// session 15, 28672x4096, us one / two tiles: 8 29.8 / 32.0, 24 63.3 / 71.7, 32 69.4 / 77.2; decode in one build
// (the old rule patched in) batch 32 5,034.8 vs 4,955.4 tok/s, batch 8 2,683.3 / 2,680.5 vs 2,644.1 / 2,682.8.
// Q5_K's kernel times moved the same way (8: 35.0 / 36.4, 32: 72.7 / 81.0 us) but its decode did not: batch 8
// 2,320.6 / 2,313.8 vs 2,376.5 / 2,374.7, batch 24 and 32 even; so it keeps the rule above.

template <class Q>
int default_row_tiles(int M, int N) {
  int one_tile_max = 0;
  if constexpr (std::is_same_v<Q, mmq::MmqQ4K>) {
    if (N >= kWideRows) return M <= 8 || M > 16 ? 1 : 2;
  }
  if constexpr (Q::kUnitScales) {
    if (N >= kWideRows) one_tile_max = 4;
    else if constexpr (std::is_same_v<Q, mmq::MmqQ4K>) one_tile_max = 4;
    else if constexpr (std::is_same_v<Q, mmq::MmqQ3K> || std::is_same_v<Q, mmq::MmqQ6K>) one_tile_max = 16;
    else one_tile_max = 8;
  }
  return M <= one_tile_max ? 1 : 2;
}

// warps: 4, 8 or 16 (16, which only a launch choice takes, with one row tile: run_mmq refuses two).
template <class Q>
void launch(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
            int row_tiles, int warps, const GgufRopeCache* rope, cudaStream_t s) {
  const int mt = row_tiles != 0 ? row_tiles : warps == 16 ? 1 : default_row_tiles<Q>(M, N);
  auto by_warps = [&](auto tiles) {
    constexpr int kMt = decltype(tiles)::value;
    if (warps == 4) launch_tokens<Q, kMt, 4>(y, bf16, xq, xb, w, M, N, K, rope, s);
    else if (warps == 8) launch_tokens<Q, kMt, 8>(y, bf16, xq, xb, w, M, N, K, rope, s);
    else if constexpr (kMt == 1) launch_tokens<Q, 1, 16>(y, bf16, xq, xb, w, M, N, K, rope, s);
    else throw std::invalid_argument("gguf_mmq: 16 warps take one row tile");
  };
  if (mt == 1) by_warps(std::integral_constant<int, 1>{});
  else by_warps(std::integral_constant<int, 2>{});
}

}  // namespace

bool gguf_mmq_supported(int qtype) {
  return mmq::dispatch(qtype, [](auto) {});
}

int gguf_mmq_warps(int qtype, int M, int N, int K) {
  if (!gguf_mmq_supported(qtype))
    throw std::invalid_argument("gguf_mmq_warps: no tensor-core kernel for GGUF type " + std::to_string(qtype));
  if (M < 1 || M > kGgufMmqMaxM || N < 1 || K < 1)
    throw std::invalid_argument("gguf_mmq_warps: M must be in 1.." + std::to_string(kGgufMmqMaxM) +
                                " and N, K positive");
  return rule_warps(qtype, N, K, gguf_mmq_staged_fits(qtype, M, K));  // a default launch's kernel choice
}

int gguf_mmq_x_group(int qtype) {
  int group = 0;
  if (!mmq::dispatch(qtype, [&](auto loader) { group = decltype(loader)::kUnitScales ? 256 : 32; }))
    throw std::invalid_argument("gguf_mmq: no tensor-core kernel for GGUF type " + std::to_string(qtype));
  return group;
}

void launch_gguf_mmq(void* y, bool bf16, const int8_t* xq, const gguf::XBlock* xb, const uint8_t* w, int M, int N,
                     int K, int qtype, int row_tiles, int warps, int staging, const GgufRopeCache* rope,
                     cudaStream_t stream) {
  const bool staged = staging == kMmqStagingShared ||
                      (staging == kMmqStagingAuto && row_tiles == 0 && gguf_mmq_staged_fits(qtype, M, K));
  const int ws = warps != 0 ? warps : rule_warps(qtype, N, K, staged);
  if (staged) {
    launch_gguf_mmq_staged(y, bf16, xq, xb, w, M, N, K, qtype, ws, rope, stream);
    return;
  }
  if (!mmq::dispatch(qtype, [&](auto loader) {
        launch<decltype(loader)>(y, bf16, xq, xb, w, M, N, K, row_tiles, ws, rope, stream);
      }))
    throw std::invalid_argument("gguf_mmq: no tensor-core kernel for GGUF type " + std::to_string(qtype));
}

}  // namespace candle_vllm::cuda
