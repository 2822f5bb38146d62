// The dp4a Parts of the GGUF K-quants with 32-element sub-blocks (Q4_K, Q5_K: a quarter block per thread).
#pragma once
#include "cuda/gguf_q8_words.cuh"

namespace candle_vllm::gguf {

// Q4_K/Q5_K 6-bit scales (sc) and mins (m) of sub-blocks 2g and 2g+1, in bytes 0 and 1, from the 12 packed
// bytes as three words: sub-block j < 4 keeps its six bits in byte j of s0 (scale) and s1 (min); j >= 4 has
// its low four bits in the nibbles of byte j - 4 of s2 and its top two in the top bits of byte j - 4 of s0/s1.
// Both sub-blocks of a pair share their bytes' word half, so one 16-bit shift serves them (no branch on j).
GGUF_HD void k4_scale_min_pair(uint32_t s0, uint32_t s1, uint32_t s2, int g, uint32_t& sc, uint32_t& m) {
  const int sh = 16 * (g & 1);
  const uint32_t a0 = s0 >> sh, a1 = s1 >> sh, c = s2 >> sh;
  const bool low = g < 2;
  sc = low ? a0 & 0x3F3Fu : (c & 0x0F0Fu) | ((a0 >> 2) & 0x3030u);
  m = low ? a1 & 0x3F3Fu : ((c >> 4) & 0x0F0Fu) | ((a1 >> 2) & 0x3030u);
}

// Q4_K/Q5_K part g: the 32 codes of sub-block 2g (lo) and of 2g+1 (hi), w = (a * code - b) per sub-block. A part
// spans a whole pair of sub-blocks so their scales and mins are decoded once for 64 weights. The hi codes are held
// times 2^kHiShift (Q4_K keeps its high nibbles in place: one mask instead of a shift and a mask).
template <int kHiShift>
struct K4Part {
  using X = XWords<2, 8>;
  uint32_t lo[8], hi[8];
  float a[2], b[2];
  // h: the block's first 16 bytes (d, dmin, the packed scales).
  GGUF_HD void decode_header(const uint4& h, int g) {
    const float d = half_lo(h.x), dmin = half_hi(h.x);
    uint32_t sc, m;
    k4_scale_min_pair(h.y, h.z, h.w, g, sc, m);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      a[i] = d * static_cast<float>((sc >> (8 * i)) & 0xFF);
      b[i] = dmin * static_cast<float>((m >> (8 * i)) & 0xFF);
    }
  }
  GGUF_HD static void load_x(X& x, const int8_t* xq, const XBlock* xb, int g) {
    ld_x_piece(x, 0, xq, xb, 64 * g, -1);
    ld_x_piece(x, 1, xq, xb, 64 * g + 32, -1);
  }
  GGUF_HD float dot(const X& x) const {
    int slo = 0, shi = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) slo = dp4a(lo[k], x.q[0][k], slo), shi = dp4a_us(hi[k], x.q[1][k], shi);
    shi >>= kHiShift;
    return x.d[0] * (a[0] * static_cast<float>(slo) - b[0] * static_cast<float>(x.sum[0])) +
           x.d[1] * (a[1] * static_cast<float>(shi) - b[1] * static_cast<float>(x.sum[1]));
  }
};

template <>
struct Q8Dot<Q4_K> : K4Part<4> {
  static constexpr int kBlockElems = 256, kBlockBytes = 144, kParts = 4;
  struct Raw {
    uint4 q[2], h;
  };
  GGUF_HD static void fetch(Raw& raw, const uint8_t* blk, int g) {  // 16-byte aligned
    raw.q[0] = ld<uint4>(blk + 16 + 32 * g);
    raw.q[1] = ld<uint4>(blk + 32 + 32 * g);
    raw.h = ld<uint4>(blk);
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t*, int g) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t qs[4] = {raw.q[i].x, raw.q[i].y, raw.q[i].z, raw.q[i].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) lo[4 * i + k] = qs[k] & kNib, hi[4 * i + k] = qs[k] & ~kNib;
    }
    decode_header(raw.h, g);
  }
};

template <>
struct Q8Dot<Q5_K> : K4Part<0> {
  static constexpr int kBlockElems = 256, kBlockBytes = 176, kParts = 4;
  struct Raw {
    uint4 q[2], e[2], h;
  };
  GGUF_HD static void fetch(Raw& raw, const uint8_t* blk, int g) {  // 16-byte aligned
    raw.q[0] = ld<uint4>(blk + 48 + 32 * g);
    raw.q[1] = ld<uint4>(blk + 64 + 32 * g);
    raw.e[0] = ld<uint4>(blk + 16);  // the fifth bits of every sub-block pair
    raw.e[1] = ld<uint4>(blk + 32);
    raw.h = ld<uint4>(blk);
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t*, int g) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t qs[4] = {raw.q[i].x, raw.q[i].y, raw.q[i].z, raw.q[i].w};
      const uint32_t qh[4] = {raw.e[i].x, raw.e[i].y, raw.e[i].z, raw.e[i].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        lo[4 * i + k] = (qs[k] & kNib) | (((qh[k] >> (2 * g)) & 0x01010101u) << 4);
        hi[4 * i + k] = ((qs[k] >> 4) & kNib) | (((qh[k] >> (2 * g + 1)) & 0x01010101u) << 4);
      }
    }
    decode_header(raw.h, g);
  }
};

}  // namespace candle_vllm::gguf
