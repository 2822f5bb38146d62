// The arithmetic of the int8 tensor-core GGUF product, shared by its two kernels (gguf_mmq.cu: weights in flight in
// registers; gguf_mmq_staged.cu: weights streamed through shared memory; gguf_mmq_multiply.cuh holds what else they
// share): the mma fragments, one unit of a tile loader's weights times a token tile (gguf_mmq.cu's header says how
// the integer dot products meet the scales).
//
// Plain integer and f32 code around the mmas, so it also compiles on the host (tests/native/host_parts/
// mma_rows.cpp, tests/native/test_gguf_host.py): there each lane of a warp runs as a thread, and the includer
// defines host_warp_mma<K, kUnsignedA>(c, a, b), the warp's mma.sync m16n8kK (s32 += A * B, A's fragment a: 4
// words for K = 32, 2 for 16; B's b: 2 or 1) from every lane's fragments, before including this header.
#pragma once
#include <cmath>

#include "cuda/gguf_mmq_loaders.cuh"

#ifdef __CUDACC__
#define MMQ_FN __device__ __forceinline__
#else
#define MMQ_FN inline
#endif

namespace candle_vllm::cuda {
namespace {

using gguf::XBlock;

// c += a[16x32] (row, s8) * b[32x8] (col, s8), s32 (PTX fragment layouts of mma.m16n8k32).
MMQ_FN void mma_s8_16832(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef __CUDACC__
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  const uint32_t b[2] = {b0, b1};
  host_warp_mma<32, false>(c, a, b);
#endif
}

// c += a[16x16] * b[16x8] (mma.m16n8k16: a0 row g, a1 row g + 8, b column g; each the k slots 4t..4t+3).
MMQ_FN void mma_s8_16816(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
#ifdef __CUDACC__
  asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a0), "r"(a1), "r"(b));
#else
  const uint32_t a[2] = {a0, a1};
  host_warp_mma<16, false>(c, a, &b);
#endif
}

// (dx, dx * sum of codes) of sub-blocks s and s + 1 of one token, from their two adjacent XBlocks (one 16-byte
// word: a token source's pair_blocks).
struct XScales {
  float d[2], s[2];
  MMQ_FN void load(uint4 raw) {
    const uint32_t words[2][2] = {{raw.x, raw.y}, {raw.z, raw.w}};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      d[h] = gguf::as_float(words[h][0]);
      const int sum = static_cast<int16_t>(words[h][1] & 0xFFFF) + static_cast<int16_t>(words[h][1] >> 16);
      s[h] = d[h] * static_cast<float>(sum);
    }
  }
};

// A token tile's activations for this lane as the arithmetic below reads them (a token source): the B words of token
// 8i + g (from its element 8t, or 4t for a loader with kSplitLanes) and the XBlocks of tokens 8i + 2t and
// 8i + 2t + 1, read through pointers by Ld::ld<V>(p) (the kernels: cached global or shared-memory loads; the host
// test: memcpy). The accessors take offsets from the current unit's first element.
template <class Ld>
struct PointerTokens {
  const int8_t* codes;
  const XBlock* blocks[2];
  // Kept at the current unit's first element (moved n elements on per unit), so its loads take constant offsets
  // instead of index math widened to 64 bits per load.
  MMQ_FN void advance(int n) { codes += n, blocks[0] += n / 32, blocks[1] += n / 32; }
  MMQ_FN PointerTokens shifted(int n) const {
    PointerTokens p = *this;
    p.advance(n);
    return p;
  }
  // The B fragment words of the sub-block from element e: the lane's codes of token 8i + g.
  template <bool kSplitLanes>
  MMQ_FN uint2 words(int e) const {
    const int8_t* p = codes + e;
    return kSplitLanes ? uint2{Ld::template ld<uint32_t>(p), Ld::template ld<uint32_t>(p + 16)}
                       : Ld::template ld<uint2>(p);
  }
  // Token 2t + k's XBlocks of sub-blocks sb and sb + 1 as one 16-byte word.
  MMQ_FN uint4 pair_blocks(int k, int sb) const { return Ld::template ld<uint4>(blocks[k] + sb); }
  // Token 2t + k's activation scale of the unit (K-quants: every XBlock of a 256-value run holds it).
  MMQ_FN float unit_scale(int k) const { return Ld::template ld<float>(&blocks[k]->d); }
};

// The same token source held in registers for one unit of loader Q. load() issues every load of the unit at once, so
// a kernel can take the next unit's tokens while it multiplies this one's and no mma waits on a load. It holds what
// the arithmetic reads of a unit: the B words, and the 32-element types' XBlock pairs or the K-quants' scales (not
// their XBlocks' half sums: the min terms by dp2a/IMAD, MT * T > 4, take pointer tokens).
template <class Q>
struct UnitTokens {
  static constexpr bool kBlocks = !Q::kUnitScales;
  uint2 w[2 * Q::kPairs];
  uint4 b[2][Q::kPairs];
  float dx[2];
  template <class P>
  MMQ_FN void load(const P& p) {
#pragma unroll
    for (int s = 0; s < 2 * Q::kPairs; ++s) w[s] = p.template words<Q::kSplitLanes>(32 * s);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if constexpr (kBlocks) {
#pragma unroll
        for (int j = 0; j < Q::kPairs; ++j) b[k][j] = p.pair_blocks(k, 2 * j);
      } else {
        dx[k] = p.unit_scale(k);
      }
    }
  }
  template <bool kSplitLanes>
  MMQ_FN uint2 words(int e) const {
    return w[e / 32];
  }
  MMQ_FN uint4 pair_blocks(int k, int sb) const {
    static_assert(kBlocks, "a K-quant's held tokens keep no XBlocks: its min terms must run on the tensor cores");
    return b[k][sb / 2];
  }
  MMQ_FN float unit_scale(int k) const { return dx[k]; }
};

// The A fragment of m-tile rows g (codes r = 0) and g + 8 (r = 1): a0/a2 row g (slots 4t.., 16+4t..), a1/a3 row g + 8.
MMQ_FN void a_fragment(const uint32_t (&c8)[2][2], uint32_t (&frag)[4]) {
  frag[0] = c8[0][0], frag[1] = c8[1][0], frag[2] = c8[0][1], frag[3] = c8[1][1];
}

// f(h, mt, frag, bw) for sub-blocks 2j + h (h = 0, 1; e: 2j's first element) and each m-tile mt: the A fragment of
// its codes (lo: sub-block 2j's, hi: 2j + 1's) and the B words of the token tile x.
template <class Q, int MT, class X, typename F>
MMQ_FN void each_fragment(const X& x, int e, const uint32_t (&lo)[MT][2][2],
                                              const uint32_t (&hi)[MT][2][2], F&& f) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint2 bw = x.template words<Q::kSplitLanes>(e + 32 * h);
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
template <class Q, int MT, int T, class X>
MMQ_FN void multiply_unit(const Q (&q)[MT][2], int t, const X (&x)[T],
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
      for (int k = 0; k < 2; ++k) xs[k].load(x[i].pair_blocks(k, e / 32));
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
// those take the XBlocks' int16 half sums by dp2a (kHalfMins: by IMAD). Bounds per unit: |dot| <= 8 sub-blocks * 63 *
// 32 * 31 * 127 (Q5_K), 8 halves * 128 * 16 * 128 * 127 (Q6_K, its codes centered at the top of the lanes: 4 x
// code - 32); |low| <= 8 * 63 * 32 * 127: all below 2^31.
template <class Q, int MT, int T, class X, bool kSplitLow = false>
MMQ_FN void multiply_unit_k(const Q (&q)[MT][2], int t, const X (&x)[T],
                                                float (&acc)[MT][T][4]) {
  static_assert(!Q::kHalfScales || Q::kSplitLanes, "a lane's first word holds the first half, its second the second");
  constexpr bool kMinMma = Q::kMins && MT * T <= 4, kMinSums = Q::kMins && !kMinMma;
  int dot[MT][T][4] = {}, low[MT][T][4] = {}, low_hi[MT][T][4] = {};  // low_hi: kSplitLow's second chain
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
        else mw[mt][r] = gguf::byte_perm(m, 0, 0x1100);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            minw[mt][r][h][half] = Q::kHalfMins ? static_cast<uint32_t>(hm[mt][r][h][half]) * 0x01010101u
                                                : gguf::byte_perm(m, 0, h ? 0x1111 : 0x0000);
      }
    const int e = 64 * j;
#pragma unroll
    for (int i = 0; i < T; ++i) {
      uint4 sums[2];  // kMinSums, per token 2t + k: the XBlocks of sub-blocks 2j, 2j + 1 (.y, .w: half sums)
      if constexpr (kMinSums)
#pragma unroll
        for (int k = 0; k < 2; ++k) sums[k] = x[i].pair_blocks(k, e / 32);
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
          if (kSplitLow && h) mma_s8_16832(low_hi[mt][i], mf, bw.x, bw.y);
          else mma_s8_16832(low[mt][i], mf, bw.x, bw.y);
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
                l = h ? gguf::dp2a<true>(xs, static_cast<int>(mw[mt][r]), l)
                      : gguf::dp2a<false>(xs, static_cast<int>(mw[mt][r]), l);
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
      const float dx = x[i].unit_scale(k);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float& o = acc[mt][i][2 * r + k];
          o = fmaf(d[mt][r] * dx, static_cast<float>(dot[mt][i][2 * r + k]), o);
          if constexpr (Q::kMins)
            o = fmaf(-dmin[mt][r] * dx, static_cast<float>(low[mt][i][2 * r + k] + low_hi[mt][i][2 * r + k]), o);
        }
    }
}

// The sums times the factor the loader left to the output (mmq::kOutputScale), once before they are stored.
template <class Q, int MT, int T>
MMQ_FN void scale_output(float (&acc)[MT][T][4]) {
  if constexpr (mmq::kOutputScale<Q> != 1.f)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < T; ++i)
#pragma unroll
        for (int o = 0; o < 4; ++o) acc[mt][i][o] *= mmq::kOutputScale<Q>;
}

// One unit times the T token tiles by the loader's arithmetic: multiply_unit_k for a K-quant, else multiply_unit.
template <class Q, int MT, int T, bool kSplitLow, class X>
MMQ_FN void multiply_any(const Q (&q)[MT][2], int t, const X (&x)[T], float (&acc)[MT][T][4]) {
  if constexpr (Q::kUnitScales) multiply_unit_k<Q, MT, T, X, kSplitLow>(q, t, x, acc);
  else multiply_unit<Q, MT, T, X>(q, t, x, acc);
}

}  // namespace
}  // namespace candle_vllm::cuda
