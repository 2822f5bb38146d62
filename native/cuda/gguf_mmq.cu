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
// then serves 32 rows) and its 4 or 8 warps split K by the loader's units (a Q4_K/Q5_K block, half a Q2_K/Q3_K/Q6_K
// block, two blocks of a 32-element type; warp w takes units w, w + W, ...), each keeping the next units' weights in
// flight in registers while it multiplies one (the first before griddepcontrol.wait: weights do not depend on the
// kernel before); partial sums meet in shared memory and warp order is fixed, so results are deterministic and a
// token's result does not depend on the other tokens or on the row tiling (the warp count sets the summation order;
// its rule depends on N and the device only).
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
#include "cuda/gguf_mmq_loaders.cuh"
#include "cuda/gguf_rope_epilogue.cuh"

namespace candle_vllm::cuda {
namespace {

using gguf::XBlock;

// c += a[16x32] (row, s8) * b[32x8] (col, s8), s32 (PTX fragment layouts of mma.m16n8k32).
__device__ __forceinline__ void mma_s8_16832(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a[16x16] * b[16x8] (mma.m16n8k16: a0 row g, a1 row g + 8, b column g; each the k slots 4t..4t+3).
__device__ __forceinline__ void mma_s8_16816(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a0), "r"(a1), "r"(b));
}

// The activations of one token tile for this lane: B words of token 8i + g (from its element 8t, or 4t for a loader
// with kSplitLanes), XBlocks of tokens 8i + 2t, 8i + 2t + 1.
struct TokenRows {
  const int8_t* codes;
  const XBlock* blocks[2];
  // Kept at the current unit's first element (moved n elements on per unit), so its loads take constant offsets
  // instead of index math widened to 64 bits per load.
  __device__ void advance(int n) { codes += n, blocks[0] += n / 32, blocks[1] += n / 32; }
};

// (dx, dx * sum of codes) of sub-blocks s and s + 1 of one token, from their two adjacent XBlocks (one 16-byte
// load).
struct XScales {
  float d[2], s[2];
  __device__ void load(const XBlock* p) {
    const uint4 raw = gguf::ld_x<uint4>(p);
    const uint32_t words[2][2] = {{raw.x, raw.y}, {raw.z, raw.w}};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      d[h] = __uint_as_float(words[h][0]);
      const int sum = static_cast<int16_t>(words[h][1] & 0xFFFF) + static_cast<int16_t>(words[h][1] >> 16);
      s[h] = d[h] * static_cast<float>(sum);
    }
  }
};

// The B fragment words of one token tile for sub-block (e / 32): the lane's codes of token 8i + g.
template <class Q>
__device__ __forceinline__ uint2 token_codes(const TokenRows& x, int e) {
  const int8_t* p = x.codes + e;
  return Q::kSplitLanes ? make_uint2(gguf::ld_x<uint32_t>(p), gguf::ld_x<uint32_t>(p + 16)) : gguf::ld_x<uint2>(p);
}

// The A fragment of m-tile rows g (codes r = 0) and g + 8 (r = 1): a0/a2 row g (slots 4t.., 16+4t..), a1/a3 row g + 8.
__device__ __forceinline__ void a_fragment(const uint32_t (&c8)[2][2], uint32_t (&frag)[4]) {
  frag[0] = c8[0][0], frag[1] = c8[1][0], frag[2] = c8[0][1], frag[3] = c8[1][1];
}

// f(h, mt, frag, bw) for sub-blocks 2j + h (h = 0, 1; e: 2j's first element) and each m-tile mt: the A fragment of
// its codes (lo: sub-block 2j's, hi: 2j + 1's) and the B words of the token tile x.
template <class Q, int MT, typename F>
__device__ __forceinline__ void each_fragment(const TokenRows& x, int e, const uint32_t (&lo)[MT][2][2],
                                              const uint32_t (&hi)[MT][2][2], F&& f) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint2 bw = token_codes<Q>(x, e + 32 * h);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint32_t frag[4];
      a_fragment(h ? hi[mt] : lo[mt], frag);
      f(h, mt, frag, bw);
    }
  }
}

// acc += one unit of this lane's weight rows (q: m-tile mt's rows g and g + 8) times the T token tiles (x: from the
// unit's first element): the 32-element types, each sub-block's dot scaled in f32 (activations scaled per 32).
template <class Q, int MT, int T>
__device__ __forceinline__ void multiply_unit(const Q (&q)[MT][2], int t, const TokenRows (&x)[T],
                                              float (&acc)[MT][T][4]) {
#pragma unroll
  for (int j = 0; j < Q::kPairs; ++j) {
    // Per m-tile: rows g and g + 8, the codes of sub-blocks 2j (lo) and 2j + 1 (hi) and their (a, b).
    uint32_t lo[MT][2][2], hi[MT][2][2];
    float a[MT][2][2], b[MT][2][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) q[mt][r].pair(j, t, lo[mt][r], hi[mt][r], a[mt][r], b[mt][r]);
    const int e = 64 * j;
#pragma unroll
    for (int i = 0; i < T; ++i) {
      XScales xs[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) xs[k].load(x[i].blocks[k] + e / 32);
      each_fragment<Q>(x[i], e, lo, hi, [&](int h, int mt, const uint32_t (&frag)[4], uint2 bw) {
        int c[4] = {};
        mma_s8_16832(c, frag, bw.x, bw.y);
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float& o = acc[mt][i][2 * r + k];
            o = fmaf(a[mt][r][h] * xs[k].d[h], static_cast<float>(c[2 * r + k]), o);
            if constexpr (Q::kMins) o = fmaf(-b[mt][r][h], xs[k].s[h], o);
          }
      });
    }
  }
}

// The same for a K-quant (Q::kUnitScales) on activations scaled per 256 values: every weight of the unit is d * sc *
// code - dmin * m with integer sc, m and one activation scale dx per token, so the unit's scaled dot products and
// min terms (m times the sum of the sub-block's or half's activation codes) add up in int32 and meet the floats once
// per unit: acc += (d * dx) * dot - (dmin * dx) * low. The min terms run on the tensor cores (one more mma per
// sub-block whose A holds the row's min, each half's with kHalfMins, in every byte) except in the 2-tile x 4-token
// kernels, where that form spills registers (session 13, call 1: q4k batch-32 decode 4,746 against 4,993 tok/s);
// those take the XBlocks' int16 half sums by dp2a (kHalfMins: by IMAD). Bounds per unit: |dot| <= 8 sub-blocks * 63 * 32 *
// 31 * 127 (Q5_K), 8 halves * 128 * 16 * 32 * 127 (Q6_K); |low| <= 8 * 63 * 32 * 127: all far below 2^31.
template <class Q, int MT, int T>
__device__ __forceinline__ void multiply_unit_k(const Q (&q)[MT][2], int t, const TokenRows (&x)[T],
                                                float (&acc)[MT][T][4]) {
  static_assert(!Q::kHalfScales || Q::kSplitLanes, "a lane's first word holds the first half, its second the second");
  constexpr bool kMinMma = Q::kMins && MT * T <= 4, kMinSums = Q::kMins && !kMinMma;
  int dot[MT][T][4] = {}, low[MT][T][4] = {};
#pragma unroll
  for (int j = 0; j < Q::kPairs; ++j) {
    uint32_t lo[MT][2][2], hi[MT][2][2];
    int sc[MT][2][2][2];      // kHalfScales: [mt][r][sub-block][half]
    uint32_t scw[MT][2];      // otherwise: sub-block 2j's in byte 0, 2j + 1's in byte 1
    int hm[MT][2][2][2];      // kHalfMins: [mt][r][sub-block][half]
    uint32_t mw[MT][2];       // kMins otherwise: 2j's min in bytes 0 and 1, 2j + 1's in 2 and 3 (dp2a)
    uint32_t minw[MT][2][2][2];  // kMinMma: [mt][r][sub-block][half], the min in every byte
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        q[mt][r].codes(j, t, lo[mt][r], hi[mt][r]);
        uint32_t m = 0;
        if constexpr (Q::kHalfScales) q[mt][r].half_scales(j, sc[mt][r]);
        else q[mt][r].scales_mins(j, scw[mt][r], m);
        if constexpr (Q::kHalfMins) q[mt][r].half_mins(j, hm[mt][r]);
        else mw[mt][r] = __byte_perm(m, 0, 0x1100);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            minw[mt][r][h][half] = Q::kHalfMins ? static_cast<uint32_t>(hm[mt][r][h][half]) * 0x01010101u
                                                : __byte_perm(m, 0, h ? 0x1111 : 0x0000);
      }
    const int e = 64 * j;
#pragma unroll
    for (int i = 0; i < T; ++i) {
      uint4 sums[2];  // kMinSums, per token 2t + k: the XBlocks of sub-blocks 2j, 2j + 1 (.y, .w: half sums)
      if constexpr (kMinSums)
#pragma unroll
        for (int k = 0; k < 2; ++k) sums[k] = gguf::ld_x<uint4>(x[i].blocks[k] + e / 32);
      each_fragment<Q>(x[i], e, lo, hi, [&](int h, int mt, const uint32_t (&frag)[4], uint2 bw) {
        int c[4] = {};
        if constexpr (Q::kHalfScales) {
          // A lane's first words (frag 0, 1; bw.x) hold its elements of the sub-block's first half, its second
          // words the second half's: one k16 mma per half, then each half's dot times its scale.
          int c0[4] = {}, c1[4] = {};
          mma_s8_16816(c0, frag[0], frag[1], bw.x);
          mma_s8_16816(c1, frag[2], frag[3], bw.y);
#pragma unroll
          for (int o = 0; o < 4; ++o) c[o] = sc[mt][o >> 1][h][0] * c0[o] + sc[mt][o >> 1][h][1] * c1[o];
        } else {
          mma_s8_16832(c, frag, bw.x, bw.y);
#pragma unroll
          for (int o = 0; o < 4; ++o) c[o] *= static_cast<int>((scw[mt][o >> 1] >> (8 * h)) & 0xFF);
        }
#pragma unroll
        for (int o = 0; o < 4; ++o) dot[mt][i][o] += c[o];
        if constexpr (kMinMma) {
          const uint32_t mf[4] = {minw[mt][0][h][0], minw[mt][1][h][0], minw[mt][0][h][1], minw[mt][1][h][1]};
          mma_s8_16832(low[mt][i], mf, bw.x, bw.y);
        } else if constexpr (kMinSums) {
#pragma unroll
          for (int k = 0; k < 2; ++k)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int xs = static_cast<int>(h ? sums[k].w : sums[k].y);
              int& l = low[mt][i][2 * r + k];
              if constexpr (Q::kHalfMins)
                l += hm[mt][r][h][0] * static_cast<int16_t>(xs & 0xFFFF) +
                     hm[mt][r][h][1] * static_cast<int16_t>(static_cast<uint32_t>(xs) >> 16);
              else
                l = h ? __dp2a_hi(xs, static_cast<int>(mw[mt][r]), l) : __dp2a_lo(xs, static_cast<int>(mw[mt][r]), l);
            }
        }
      });
    }
  }
  float d[MT][2], dmin[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) q[mt][r].unit_scales(d[mt][r], dmin[mt][r]);
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float dx = gguf::ld_x<float>(&x[i].blocks[k]->d);  // every XBlock of a 256-value run holds it
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float& o = acc[mt][i][2 * r + k];
          o = fmaf(d[mt][r] * dx, static_cast<float>(dot[mt][i][2 * r + k]), o);
          if constexpr (Q::kMins) o = fmaf(-dmin[mt][r] * dx, static_cast<float>(low[mt][i][2 * r + k]), o);
        }
    }
}

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
  const int e0 = warp * Q::kBlockElems;
#pragma unroll
  for (int i = 0; i < T; ++i) {
    x[i].codes = xq + static_cast<int64_t>(min(8 * i + g, M - 1)) * K + e0 + (Q::kSplitLanes ? 4 : 8) * t;
#pragma unroll
    for (int k = 0; k < 2; ++k)
      x[i].blocks[k] = xb + static_cast<int64_t>(min(8 * i + 2 * t + k, M - 1)) * (K / 32) + e0 / 32;
  }
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
        if constexpr (Q::kUnitScales) multiply_unit_k(cur, t, x, acc);
        else multiply_unit(cur, t, x, acc);
#pragma unroll
        for (int i = 0; i < T; ++i) x[i].advance(W * Q::kBlockElems);
      }
    }
  }
  pdl_launch_dependents();

  __shared__ float red[W][kRows][8 * T + 1];
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
  for (int o = threadIdx.x; o < kRows * 8 * T; o += W * 32) {
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

template <class Q, int MT, int T, int W>
void launch_tiles(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
                  const GgufRopeCache* rope, cudaStream_t s) {
  const int64_t row_bytes = static_cast<int64_t>(K / Q::kBlockElems) * Q::kBlockBytes;
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
// a token's result does not depend on how many tokens share its launch (it may differ between GPU models).
int default_warps(int N) { return (N + 31) / 32 < device_sm_count() ? 8 : 4; }

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
constexpr int kWideRows = 16384;  // a grid of 16-row CTAs this tall is many waves deep

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

template <class Q>
void launch(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
            int row_tiles, int warps, const GgufRopeCache* rope, cudaStream_t s) {
  const int ws = warps != 0 ? warps : default_warps(N);
  const int mt = row_tiles != 0 ? row_tiles : default_row_tiles<Q>(M, N);
  if (mt == 1 && ws == 4) launch_tokens<Q, 1, 4>(y, bf16, xq, xb, w, M, N, K, rope, s);
  else if (mt == 1) launch_tokens<Q, 1, 8>(y, bf16, xq, xb, w, M, N, K, rope, s);
  else if (ws == 4) launch_tokens<Q, 2, 4>(y, bf16, xq, xb, w, M, N, K, rope, s);
  else launch_tokens<Q, 2, 8>(y, bf16, xq, xb, w, M, N, K, rope, s);
}

}  // namespace

bool gguf_mmq_supported(int qtype) {
  return mmq::dispatch(qtype, [](auto) {});
}

int gguf_mmq_x_group(int qtype) {
  int group = 0;
  if (!mmq::dispatch(qtype, [&](auto loader) { group = decltype(loader)::kUnitScales ? 256 : 32; }))
    throw std::invalid_argument("gguf_mmq: no tensor-core kernel for GGUF type " + std::to_string(qtype));
  return group;
}

void launch_gguf_mmq(void* y, bool bf16, const int8_t* xq, const gguf::XBlock* xb, const uint8_t* w, int M, int N,
                     int K, int qtype, int row_tiles, int warps, const GgufRopeCache* rope, cudaStream_t stream) {
  if (!mmq::dispatch(qtype, [&](auto loader) {
        launch<decltype(loader)>(y, bf16, xq, xb, w, M, N, K, row_tiles, warps, rope, stream);
      }))
    throw std::invalid_argument("gguf_mmq: no tensor-core kernel for GGUF type " + std::to_string(qtype));
}

}  // namespace candle_vllm::cuda
