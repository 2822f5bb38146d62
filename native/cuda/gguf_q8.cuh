// GGUF weights against int8-quantized activations (dp4a dot products), shared by the decode GEMV kernel and a
// host check. Plain integer code with host fallbacks for the CUDA intrinsics.
//
// Activations: int8 codes per 32-element block plus an XBlock (q8_activation.cuh); the XBlock's code sums give
// the offset and min terms of the weight formulas without per-element work.
//
// A weight block is shared by kParts threads; each thread's Part loads its share of the block's bytes with the
// widest loads the block's alignment allows, turns them into int8-lane words (4 codes per word) plus float
// scales once, and its dot() is then used for every activation row. X<Q> holds the matching activation words.
// Loading is two steps: fetch() only issues the loads into a small Raw (the loaded words as they are),
// decode(raw, blk, p) turns them into the Part's codes and scales.
// Part p's elements, per type:
//  - Q4_0/Q4_1/Q5_0/Q5_1 (kParts 1): the whole 32-element block.
//  - Q8_0 (kParts 2): elements 16p..16p+15.
//  - Q4_K/Q5_K (kParts 4): g = p: elements 64g+[0,32) (sub-block 2g) and 64g+32+[0,32) (sub-block 2g+1).
//  - Q6_K (kParts 4): h = p/2, l0 = 16(p%2): elements 128h+32q+l0+[0,16) for q = 0..3.
#pragma once
#include <cstdint>

#ifndef __CUDACC__
#include <vector_types.h>
#endif

#include "cuda/gguf_decode.cuh"
#include "cuda/q8_activation.cuh"

namespace candle_vllm::gguf {

constexpr uint32_t kNib = 0x0F0F0F0Fu;

GGUF_HD int dp4a(uint32_t a, uint32_t b, int c) {
#ifdef __CUDA_ARCH__
  return __dp4a(static_cast<int>(a), static_cast<int>(b), c);
#else
  for (int i = 0; i < 4; ++i)
    c += static_cast<int8_t>(a >> (8 * i)) * static_cast<int8_t>(b >> (8 * i));
  return c;
#endif
}

// The same with a's bytes unsigned (0..255): a high nibble kept in place (16 x code) is one mask, no shift.
GGUF_HD int dp4a_us(uint32_t a, uint32_t b, int c) {
#ifdef __CUDA_ARCH__
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  for (int i = 0; i < 4; ++i)
    c += static_cast<int>((a >> (8 * i)) & 0xFF) * static_cast<int8_t>(b >> (8 * i));
  return c;
#endif
}

// Bits 32..63 of (hi:lo) >> 16.
GGUF_HD uint32_t mid16(uint32_t lo, uint32_t hi) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, 16);
#else
  return (lo >> 16) | (hi << 16);
#endif
}

// A V of the quantized activations at p. The quantizer that writes them may still run when the GEMV starts
// (programmatic dependent launch), so these are ordinary cached loads issued after griddepcontrol.wait, never
// the read-only path (.nc), which assumes the data is constant for the GEMV's whole lifetime.
template <typename V>
GGUF_HD V ld_x(const void* p) {
#ifdef __CUDA_ARCH__
  return __ldca(static_cast<const V*>(p));
#else
  return *static_cast<const V*>(p);
#endif
}

// A V of the weights (immutable: the read-only path).
template <typename V>
GGUF_HD V ld(const void* p) {
#ifdef __CUDA_ARCH__
  return __ldg(static_cast<const V*>(p));
#else
  return *static_cast<const V*>(p);
#endif
}

GGUF_HD bool odd_half(const uint8_t* p) { return (reinterpret_cast<std::uintptr_t>(p) & 2) != 0; }

// The aligned words holding bytes [p, p + 4N) of a 2-byte aligned p (N + 1 when p is not 4-byte aligned).
template <int N>
struct A2Words {
  uint32_t w[N + 1];
  bool odd;  // p % 4 == 2: the bytes straddle w[0..N]
};

template <int N>
GGUF_HD void fetch_a2(A2Words<N>& raw, const uint8_t* p) {
  const bool odd = odd_half(p);
  const uint32_t* a = reinterpret_cast<const uint32_t*>(p - (odd ? 2 : 0));
#pragma unroll
  for (int i = 0; i < N; ++i) raw.w[i] = ld<uint32_t>(a + i);
  raw.w[N] = odd ? ld<uint32_t>(a + N) : 0u;
  raw.odd = odd;
}

// Bytes [p, p + 4N) as N words from the fetched aligned words.
template <int N>
GGUF_HD void words_a2(const A2Words<N>& raw, uint32_t (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = raw.odd ? mid16(raw.w[i], raw.w[i + 1]) : raw.w[i];
}

GGUF_HD float half_lo(uint32_t w) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFF)));
#else
  const uint8_t b[2] = {static_cast<uint8_t>(w), static_cast<uint8_t>(w >> 8)};
  return f16(b);
#endif
}
GGUF_HD float half_hi(uint32_t w) { return half_lo(w >> 16); }

// The aligned word holding the f16 at a 2-byte aligned p, and that f16 as f32.
GGUF_HD uint32_t fetch_f16_a2(const uint8_t* p) { return ld<uint32_t>(p - (odd_half(p) ? 2 : 0)); }
GGUF_HD float f16_a2(uint32_t w, const uint8_t* p) { return odd_half(p) ? half_hi(w) : half_lo(w); }

// Bit 4 of byte j = bit j of the low 4 bits of n (the fifth bit of 4 adjacent 5-bit codes).
GGUF_HD uint32_t bit4_of_bytes(uint32_t n) { return ((n & 0xF) * 0x00204081u & 0x01010101u) << 4; }

// Activation words and scales for one Part: kPieces pieces of kWords words, each piece in one 32-element block.
template <int kPieces, int kWords>
struct XWords {
  uint32_t q[kPieces][kWords];
  float d[kPieces];
  int sum[kPieces];
};

GGUF_HD void ld_x_words(const int8_t* p, uint32_t* out, int words) {
  if (words == 4) {
    const uint4 v = ld_x<uint4>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  } else if (words == 8) {
    const uint4 a = ld_x<uint4>(p), b = ld_x<uint4>(p + 16);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    const uint2 v = ld_x<uint2>(p);
    out[0] = v.x, out[1] = v.y;
  }
}

// Piece i of X: kWords words at element e of the row (e within 32-element block e / 32); half: which 16-element
// half's code sum to keep (-1: both).
template <int P, int W>
GGUF_HD void ld_x_piece(XWords<P, W>& x, int i, const int8_t* xq, const XBlock* xb, int e, int half) {
  ld_x_words(xq + e, x.q[i], W);
  const uint2 b = ld_x<uint2>(xb + e / 32);  // an XBlock
  const int s0 = static_cast<int16_t>(b.y & 0xFFFF), s1 = static_cast<int16_t>(b.y >> 16);
#ifdef __CUDA_ARCH__
  x.d[i] = __uint_as_float(b.x);
#else
  std::memcpy(&x.d[i], &b.x, 4);
#endif
  x.sum[i] = half < 0 ? s0 + s1 : half == 0 ? s0 : s1;
}

// ---- 32-element types: one thread per block --------------------------------------------------------------

// The 16 code bytes of a Q4_0/Q4_1 block -> low nibbles (elements 0..15) and high nibbles (16..31). The high
// nibbles stay in place (16 x code) and the sum is divided back exactly.
GGUF_HD int dot_nibbles(const uint32_t (&qs)[4], const XWords<2, 4>& x, int& lo, int& hi) {
  lo = 0, hi = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    lo = dp4a(qs[k] & kNib, x.q[0][k], lo);
    hi = dp4a_us(qs[k] & ~kNib, x.q[1][k], hi);
  }
  hi >>= 4;
  return lo + hi;
}

template <int Q>
struct Q8Dot;

// Shared by the 32-element types: X is the block's two 16-element halves.
struct Block32X {
  using X = XWords<2, 4>;
  GGUF_HD static void load_x(X& x, const int8_t* xq, const XBlock* xb, int) {
    ld_x_piece(x, 0, xq, xb, 0, 0);
    ld_x_piece(x, 1, xq, xb, 16, 1);
  }
};

template <>
struct Q8Dot<Q4_0> : Block32X {
  static constexpr int kBlockElems = 32, kBlockBytes = 18, kParts = 1;
  struct Raw {
    A2Words<4> qs;
    uint32_t d;
  };
  uint32_t qs[4];
  float d;
  GGUF_HD static void fetch(Raw& raw, const uint8_t* b, int) {
    fetch_a2(raw.qs, b + 2);
    raw.d = fetch_f16_a2(b);
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t* b, int) {
    words_a2(raw.qs, qs);
    d = f16_a2(raw.d, b);
  }
  GGUF_HD float dot(const X& x) const {
    int lo, hi;
    const int s = dot_nibbles(qs, x, lo, hi) - 8 * (x.sum[0] + x.sum[1]);
    return d * x.d[0] * static_cast<float>(s);
  }
};

template <>
struct Q8Dot<Q4_1> : Block32X {
  static constexpr int kBlockElems = 32, kBlockBytes = 20, kParts = 1;
  struct Raw {
    uint32_t dm, qs[4];
  };
  uint32_t qs[4];
  float d, m;
  GGUF_HD static void fetch(Raw& raw, const uint8_t* b, int) {  // 4-byte aligned
    raw.dm = ld<uint32_t>(b);
#pragma unroll
    for (int k = 0; k < 4; ++k) raw.qs[k] = ld<uint32_t>(b + 4 + 4 * k);
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t*, int) {
#pragma unroll
    for (int k = 0; k < 4; ++k) qs[k] = raw.qs[k];
    d = half_lo(raw.dm), m = half_hi(raw.dm);
  }
  GGUF_HD float dot(const X& x) const {
    int lo, hi;
    const int s = dot_nibbles(qs, x, lo, hi);
    return x.d[0] * (d * static_cast<float>(s) + m * static_cast<float>(x.sum[0] + x.sum[1]));
  }
};

// Q5_0/Q5_1: nibbles plus the fifth bits from the 32-bit qh word (bit i = element i).
GGUF_HD void add_fifth_bits(uint32_t (&lo)[4], uint32_t (&hi)[4], const uint32_t (&qs)[4], uint32_t qh) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    lo[k] = (qs[k] & kNib) | bit4_of_bytes(qh >> (4 * k));
    hi[k] = ((qs[k] >> 4) & kNib) | bit4_of_bytes(qh >> (16 + 4 * k));
  }
}

GGUF_HD int dot_codes(const uint32_t (&lo)[4], const uint32_t (&hi)[4], const XWords<2, 4>& x) {
  int s = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) s = dp4a(lo[k], x.q[0][k], s), s = dp4a(hi[k], x.q[1][k], s);
  return s;
}

template <>
struct Q8Dot<Q5_0> : Block32X {
  static constexpr int kBlockElems = 32, kBlockBytes = 22, kParts = 1;
  struct Raw {
    A2Words<4> qs;
    A2Words<1> qh;
    uint32_t d;
  };
  uint32_t lo[4], hi[4];
  float d;
  GGUF_HD static void fetch(Raw& raw, const uint8_t* b, int) {
    fetch_a2(raw.qs, b + 6);
    fetch_a2(raw.qh, b + 2);
    raw.d = fetch_f16_a2(b);
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t* b, int) {
    uint32_t qs[4], qh[1];
    words_a2(raw.qs, qs);
    words_a2(raw.qh, qh);
    d = f16_a2(raw.d, b);
    add_fifth_bits(lo, hi, qs, qh[0]);
  }
  GGUF_HD float dot(const X& x) const {
    const int s = dot_codes(lo, hi, x) - 16 * (x.sum[0] + x.sum[1]);
    return d * x.d[0] * static_cast<float>(s);
  }
};

template <>
struct Q8Dot<Q5_1> : Block32X {
  static constexpr int kBlockElems = 32, kBlockBytes = 24, kParts = 1;
  struct Raw {
    uint2 h, q0, q1;
  };
  uint32_t lo[4], hi[4];
  float d, m;
  GGUF_HD static void fetch(Raw& raw, const uint8_t* b, int) {  // 8-byte aligned
    raw.h = ld<uint2>(b), raw.q0 = ld<uint2>(b + 8), raw.q1 = ld<uint2>(b + 16);
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t*, int) {
    const uint32_t qs[4] = {raw.q0.x, raw.q0.y, raw.q1.x, raw.q1.y};
    d = half_lo(raw.h.x), m = half_hi(raw.h.x);
    add_fifth_bits(lo, hi, qs, raw.h.y);
  }
  GGUF_HD float dot(const X& x) const {
    const int s = dot_codes(lo, hi, x);
    return x.d[0] * (d * static_cast<float>(s) + m * static_cast<float>(x.sum[0] + x.sum[1]));
  }
};

template <>
struct Q8Dot<Q8_0> {
  static constexpr int kBlockElems = 32, kBlockBytes = 34, kParts = 2;
  using X = XWords<1, 4>;
  struct Raw {
    A2Words<4> qs;
    uint32_t d;
  };
  uint32_t qs[4];
  float d;
  GGUF_HD static void fetch(Raw& raw, const uint8_t* b, int p) {
    fetch_a2(raw.qs, b + 2 + 16 * p);
    raw.d = fetch_f16_a2(b);
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t* b, int p) {
    words_a2(raw.qs, qs);
    d = f16_a2(raw.d, b);
  }
  GGUF_HD static void load_x(X& x, const int8_t* xq, const XBlock* xb, int p) { ld_x_piece(x, 0, xq, xb, 16 * p, p); }
  GGUF_HD float dot(const X& x) const {
    int s = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) s = dp4a(qs[k], x.q[0][k], s);
    return d * x.d[0] * static_cast<float>(s);
  }
};

// ---- 256-element types -------------------------------------------------------------------------------------

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

// Codes 0..63 per byte -> code - 32 as int8 lanes (no carries: code + 96 < 256).
GGUF_HD uint32_t minus32(uint32_t c) { return (c + 0x60606060u) ^ 0x80808080u; }

template <>
struct Q8Dot<Q6_K> {
  static constexpr int kBlockElems = 256, kBlockBytes = 210, kParts = 4;
  using X = XWords<4, 4>;
  struct Raw {
    A2Words<4> qa, qb, qh;
    A2Words<2> sc;
    uint32_t d;
  };
  uint32_t c[4][4];  // quarter q (elements 128h + 32q + l0 ..), four words of 4 signed codes
  float a[4];
  GGUF_HD static void fetch(Raw& raw, const uint8_t* blk, int p) {
    const int h = p >> 1, l0 = 16 * (p & 1);
    fetch_a2(raw.qa, blk + 64 * h + l0);
    fetch_a2(raw.qb, blk + 64 * h + 32 + l0);
    fetch_a2(raw.qh, blk + 128 + 32 * h + l0);
    fetch_a2(raw.sc, blk + 192 + 8 * h);
    raw.d = fetch_f16_a2(blk + 208);
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t* blk, int p) {
    const int is = p & 1;
    uint32_t qa[4], qb[4], qh[4], sc[2];
    words_a2(raw.qa, qa);
    words_a2(raw.qb, qb);
    words_a2(raw.qh, qh);
    words_a2(raw.sc, sc);
    const float d = f16_a2(raw.d, blk + 208);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c[0][k] = minus32((qa[k] & kNib) | ((qh[k] << 4) & 0x30303030u));
      c[1][k] = minus32((qb[k] & kNib) | ((qh[k] << 2) & 0x30303030u));
      c[2][k] = minus32(((qa[k] >> 4) & kNib) | (qh[k] & 0x30303030u));
      c[3][k] = minus32(((qb[k] >> 4) & kNib) | ((qh[k] >> 2) & 0x30303030u));
    }
    // Scale of quarter q: byte is + 2q of the 8 at 192 + 8h.
#pragma unroll
    for (int q = 0; q < 4; ++q)
      a[q] = d * static_cast<float>(static_cast<int8_t>(sc[q >> 1] >> (8 * (is + 2 * (q & 1)))));
  }
  GGUF_HD static void load_x(X& x, const int8_t* xq, const XBlock* xb, int p) {
    const int h = p >> 1, l0 = 16 * (p & 1);
#pragma unroll
    for (int q = 0; q < 4; ++q) ld_x_piece(x, q, xq, xb, 128 * h + 32 * q + l0, p & 1);
  }
  GGUF_HD float dot(const X& x) const {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      int t = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) t = dp4a(c[q][k], x.q[q][k], t);
      s += a[q] * x.d[q] * static_cast<float>(t);
    }
    return s;
  }
};

// Calls f(Q8Dot<Q>{}) for the types with an int8-activation GEMV; false for the others.
template <typename F>
GGUF_HD bool dispatch_q8(int q, F&& f) {
  switch (q) {
    case Q4_0: f(Q8Dot<Q4_0>{}); return true;
    case Q4_1: f(Q8Dot<Q4_1>{}); return true;
    case Q5_0: f(Q8Dot<Q5_0>{}); return true;
    case Q5_1: f(Q8Dot<Q5_1>{}); return true;
    case Q8_0: f(Q8Dot<Q8_0>{}); return true;
    case Q4_K: f(Q8Dot<Q4_K>{}); return true;
    case Q5_K: f(Q8Dot<Q5_K>{}); return true;
    case Q6_K: f(Q8Dot<Q6_K>{}); return true;
    default: return false;
  }
}

}  // namespace candle_vllm::gguf
