// The dp4a Parts of the 32-element GGUF types (Q4_0, Q4_1, Q5_0, Q5_1: one thread per block; Q8_0: two).
#pragma once
#include "cuda/gguf_q8_words.cuh"

namespace candle_vllm::gguf {

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
    d = f16_a2(raw.d);
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

// Q5_0 and Q8_0 in the CUDA layout (gguf_block.cuh: b is the block's GGUF position; its 16-byte aligned codes, qh and
// d in its group). One-token loop at 4 rows, against GGUF's 2-byte aligned blocks: Q5_0 466 -> 341 SASS instructions
// (35 -> 15 loads), Q8_0 189 -> 150 (26 -> 10).
template <>
struct Q8Dot<Q5_0> : Block32X {
  static constexpr int kBlockElems = 32, kBlockBytes = 22, kParts = 1;
  struct Raw {
    uint4 qs;
    uint32_t qh, d;
  };
  uint32_t lo[4], hi[4];
  float d;
  GGUF_HD static void fetch(Raw& raw, const uint8_t* b, int) {
    raw.qs = ld<uint4>(grouped_body<Q5_0>(b));
    raw.qh = ld<uint32_t>(grouped_field<Q5_0>(b, kQ5_0Qh));
    raw.d = fetch_f16_a2(grouped_field<Q5_0>(b, kBlock32D));
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t*, int) {
    const uint32_t qs[4] = {raw.qs.x, raw.qs.y, raw.qs.z, raw.qs.w};
    d = f16_a2(raw.d);
    add_fifth_bits(lo, hi, qs, raw.qh);
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
    uint4 qs;
    uint32_t d;
  };
  uint32_t qs[4];
  float d;
  GGUF_HD static void fetch(Raw& raw, const uint8_t* b, int p) {
    raw.qs = ld<uint4>(grouped_body<Q8_0>(b) + 16 * p);
    raw.d = fetch_f16_a2(grouped_field<Q8_0>(b, kBlock32D));
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t*, int) {
    qs[0] = raw.qs.x, qs[1] = raw.qs.y, qs[2] = raw.qs.z, qs[3] = raw.qs.w;
    d = f16_a2(raw.d);
  }
  GGUF_HD static void load_x(X& x, const int8_t* xq, const XBlock* xb, int p) { ld_x_piece(x, 0, xq, xb, 16 * p, p); }
  GGUF_HD float dot(const X& x) const {
    int s = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) s = dp4a(qs[k], x.q[0][k], s);
    return d * x.d[0] * static_cast<float>(s);
  }
};

}  // namespace candle_vllm::gguf
