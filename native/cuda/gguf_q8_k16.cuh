// The dp4a Parts of the GGUF K-quants with 16-element sub-blocks (Q2_K, Q3_K, Q6_K; the contract is in gguf_q8.cuh).
//
// All three lay a 256-element block out in two 128-element halves h, each of whose code bytes serves four
// sub-blocks at once (Q2_K/Q3_K: bits 2q and 2q + 1 of byte l; Q6_K: the nibbles of two planes), so part p takes
// h = p / 2 and s = p % 2: elements 128h + 32q + 16s + [0, 16) for q = 0..3, four 16-element pieces, piece q being
// sub-block 8h + 2q + s (its own scale) and half s of activation block 4h + q. A thread then reads 16 contiguous
// bytes of each code plane it needs (Q2_K one, Q3_K two, Q6_K three) and the words holding its four scales (Q2_K and
// Q6_K two, Q3_K all three of its packed 6-bit scales).
#pragma once
#include "cuda/gguf_q8_words.cuh"

namespace candle_vllm::gguf {

// The activation pieces of such a Part, and the byte of its piece q's scale in the two words holding scale bytes
// 8h .. 8h + 7 (sub-blocks 8h + 2q + s: byte s + 2 (q % 2) of word q / 2).
struct SixteenPieces {
  using X = XWords<4, 4>;
  GGUF_HD static void load_x(X& x, const int8_t* xq, const XBlock* xb, int p) {
    const int h = p >> 1, s = p & 1;
#pragma unroll
    for (int q = 0; q < 4; ++q) ld_x_piece(x, q, xq, xb, 128 * h + 32 * q + 16 * s, s);
  }
  GGUF_HD static uint32_t scale_byte(const uint32_t (&w)[2], int q, int p) {
    return (w[q >> 1] >> (8 * ((p & 1) + 2 * (q & 1)))) & 0xFF;
  }
  // t + the integer dot of a piece's 16 codes (four words of int8 lanes) with its activation codes.
  GGUF_HD static int piece_dot(const uint32_t (&c)[4], const uint32_t (&x)[4], int t) {
#pragma unroll
    for (int k = 0; k < 4; ++k) t = dp4a(c[k], x[k], t);
    return t;
  }
};

// Q2_K (84 bytes: 16 scale bytes, low nibble the sub-block's scale and high nibble its min; 64 code bytes, four
// 2-bit codes each; f16 d and dmin): w = d * sc * code - dmin * m. Sub-block 8h + 2q + s takes bits 2q, 2q + 1 of
// code bytes 32h + 16s + [0, 16). Blocks are 84 bytes apart, so 4-byte aligned: word loads.
template <>
struct Q8Dot<Q2_K> : SixteenPieces {
  static constexpr int kBlockElems = 256, kBlockBytes = 84, kParts = 4;
  struct Raw {
    uint32_t q[4], sc[2], dm;
  };
  uint32_t c[4][4];  // piece q: four words of its codes in place (bits 2q, 2q + 1: 4^q times the code)
  int sc[4];         // piece q's scale
  float m[4];        // piece q's min
  float d, dmin;
  GGUF_HD static void fetch(Raw& raw, const uint8_t* blk, int p) {
    const int h = p >> 1, s = p & 1;
#pragma unroll
    for (int k = 0; k < 4; ++k) raw.q[k] = ld<uint32_t>(blk + 16 + 32 * h + 16 * s + 4 * k);
    raw.sc[0] = ld<uint32_t>(blk + 8 * h);
    raw.sc[1] = ld<uint32_t>(blk + 8 * h + 4);
    raw.dm = ld<uint32_t>(blk + 80);
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t*, int p) {
    d = half_lo(raw.dm), dmin = half_hi(raw.dm);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
#pragma unroll
      for (int k = 0; k < 4; ++k) c[q][k] = raw.q[k] & (0x03030303u << (2 * q));
      const uint32_t sm = scale_byte(raw.sc, q, p);
      sc[q] = static_cast<int>(sm & 0xF);
      m[q] = static_cast<float>(sm >> 4);
    }
  }
  // d * sum_q dx_q * sc_q * dot_q - dmin * sum_q m_q * dx_q * xsum_q. The codes' dot comes 4^q times too large and
  // dx_q takes 4^-q: a power of two either way, so the product is exact as if the dot were shifted (|sc * 4^q * dot|
  // <= 15 * 64 * 16 * 3 * 127 < 2^24, so its float is exact too). The activations' terms (dx_q 4^-q, dx_q xsum_q)
  // are the same for every row of a launch's unrolled rows, which the compiler computes once. One-token loop (sm_90a
  // SASS): 592 -> 547 instructions at 4 rows, 1064 -> 967 at 8. H100, session 55, against the form that scaled each
  // piece's dot and min apart (two calls): one-token kernels 6144x4096 -19 / -17 %, 28672x4096 -8 / -5 %, 4096x14336
  // +2.5 / +7 %; q2k decode at 4k context, batch 1 466.5 / 458.2 / 455.4 against 461.8 / 458.7 / 442.7 tok/s, batch 2
  // 880.4 / 867.3 against 865.5 / 854.5 / 856.2 (and one cold first run of 804.4).
  GGUF_HD float dot(const X& x) const {
    float main = 0.f, low = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      int t = 0;  // bytes up to 192, so unsigned
#pragma unroll
      for (int k = 0; k < 4; ++k) t = dp4a_us(c[q][k], x.q[q][k], t);
      main += x.d[q] * (1.f / static_cast<float>(1 << (2 * q))) * static_cast<float>(sc[q] * t);
      low += m[q] * (x.d[q] * static_cast<float>(x.sum[q]));
    }
    return d * main - dmin * low;
  }
};

// Q3_K (110 bytes: 32 bytes of high bits, 64 bytes of 2-bit low parts laid out as Q2_K's codes, 12 bytes packing
// sixteen 6-bit scales, f16 d): w = d * (scale - 32) * (low + 4 * high - 4). Sub-block 8h + 2q + s takes bit 4h + q
// of high-bit bytes 16s + [0, 16). The scales: bytes 0..3 and 4..7 hold the low nibbles of scales 0..7 (low nibble)
// and 8..15 (high nibble), bytes 8..11 their top two bits (scale 4i + j: bits 2i, 2i + 1 of byte 8 + j); half h's
// scales 8h .. 8h + 7 are two words. The blocks are in the CUDA layout (gguf_block.cuh: 16-byte aligned bodies, the
// scales 4-byte aligned in the group's header), so a part is two 16-byte loads, three words of scales and d.
template <>
struct Q8Dot<Q3_K> : SixteenPieces {
  static constexpr int kBlockElems = 256, kBlockBytes = 110, kParts = 4;
  struct Raw {
    uint4 q, hm;
    uint32_t sc[3];
    uint32_t d;
  };
  uint32_t c[4][4];  // piece q: four words of 4 codes low + 4 * high (0..7; the -4 is taken from the code sums)
  int sc[4];         // piece q's scale, -32..31
  float d;
  GGUF_HD static void fetch(Raw& raw, const uint8_t* blk, int p) {
    const int h = p >> 1, s = p & 1;
    const uint8_t *body = grouped_body<Q3_K>(blk), *sc = grouped_field<Q3_K>(blk, kQ3KScales);
    raw.q = ld<uint4>(body + 32 + 32 * h + 16 * s);
    raw.hm = ld<uint4>(body + 16 * s);
#pragma unroll
    for (int i = 0; i < 3; ++i) raw.sc[i] = ld<uint32_t>(sc + 4 * i);
    raw.d = fetch_f16_a2(grouped_field<Q3_K>(blk, kQ3KD));
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t*, int p) {
    const int h = p >> 1;
    const uint32_t q[4] = {raw.q.x, raw.q.y, raw.q.z, raw.q.w};
    const uint32_t hm[4] = {raw.hm.x, raw.hm.y, raw.hm.z, raw.hm.w};
    const uint32_t* packed = raw.sc;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t high = hm[k] >> (4 * h);
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j][k] = ((q[k] >> (2 * j)) & 0x03030303u) | (((high >> j) & 0x01010101u) << 2);
    }
    const uint32_t six[2] = {((packed[0] >> (4 * h)) & kNib) | (((packed[2] >> (4 * h)) & 0x03030303u) << 4),
                             ((packed[1] >> (4 * h)) & kNib) | (((packed[2] >> (4 * h + 2)) & 0x03030303u) << 4)};
    d = f16_a2(raw.d);
#pragma unroll
    for (int j = 0; j < 4; ++j) sc[j] = static_cast<int>(scale_byte(six, j, p)) - 32;
  }
  // d * sum_q dx_q * (sc_q * dot_q), as Q2_K: |sc * dot| <= 32 * 16 * 4 * 127 < 2^24, so its float is exact, and d
  // is applied once. One-token loop (sm_90a SASS, 4 rows) 729 -> 697 instructions; H100, session 56, against d * sc
  // per piece in floats: one-token kernels -0.5..-5.3 % (4096x14336 13.23 -> 12.52 us), q3k decode at 4k context
  // batch 1 417.1 against 414.0 tok/s, batch 2 777.3 against 772.0.
  GGUF_HD float dot(const X& x) const {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) s += x.d[q] * static_cast<float>(sc[q] * piece_dot(c[q], x.q[q], -4 * x.sum[q]));
    return d * s;
  }
};

// Q6_K (210 bytes: ql[128] low nibbles, qh[64] top two bits, 16 int8 scales, f16 d; w = d * sc * (code - 32)):
// sub-block 8h + 2q + s takes nibble q / 2 of plane q % 2 (ql bytes 64h + 32 (q % 2) + 16s + [0, 16)) and bits 2q,
// 2q + 1 of qh bytes 32h + 16s + [0, 16). The dot takes the codes as they are (0..63) and starts from -32 times
// the piece's activation code sum, which the XBlock load brings anyway: the same integer as centering each code,
// two instructions per code word fewer (one-token loop at 4 rows: 965 -> 850 SASS instructions). The blocks are in
// the CUDA layout (gguf_block.cuh, grouped_body): a part is three 16-byte loads, 8 bytes of scales and d (one-token
// loop at 4 rows: 850 -> 561 instructions, 84 -> 28 loads, against GGUF's 2-byte aligned blocks).
template <>
struct Q8Dot<Q6_K> : SixteenPieces {
  static constexpr int kBlockElems = 256, kBlockBytes = 210, kParts = 4;
  struct Raw {
    uint4 qa, qb, qh;
    uint2 sc;
    uint32_t d;
  };
  uint32_t c[4][4];  // piece q: four words of 4 codes 0..63 (the -32 is taken from the code sums)
  float a[4];
  GGUF_HD static void fetch(Raw& raw, const uint8_t* blk, int p) {
    const int h = p >> 1, l0 = 16 * (p & 1);
    const uint8_t* body = grouped_body<Q6_K>(blk);
    raw.qa = ld<uint4>(body + 64 * h + l0);
    raw.qb = ld<uint4>(body + 64 * h + 32 + l0);
    raw.qh = ld<uint4>(body + 128 + 32 * h + l0);
    raw.sc = ld<uint2>(body + 192 + 8 * h);
    raw.d = fetch_f16_a2(grouped_field<Q6_K>(blk, kQ6KD));
  }
  GGUF_HD void decode(const Raw& raw, const uint8_t*, int p) {
    const uint32_t qa[4] = {raw.qa.x, raw.qa.y, raw.qa.z, raw.qa.w};
    const uint32_t qb[4] = {raw.qb.x, raw.qb.y, raw.qb.z, raw.qb.w};
    const uint32_t qh[4] = {raw.qh.x, raw.qh.y, raw.qh.z, raw.qh.w};
    const uint32_t sc[2] = {raw.sc.x, raw.sc.y};
    const float d = f16_a2(raw.d);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c[0][k] = (qa[k] & kNib) | ((qh[k] << 4) & 0x30303030u);
      c[1][k] = (qb[k] & kNib) | ((qh[k] << 2) & 0x30303030u);
      c[2][k] = ((qa[k] >> 4) & kNib) | (qh[k] & 0x30303030u);
      c[3][k] = ((qb[k] >> 4) & kNib) | ((qh[k] >> 2) & 0x30303030u);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) a[q] = d * static_cast<float>(static_cast<int8_t>(scale_byte(sc, q, p)));
  }
  GGUF_HD float dot(const X& x) const {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      s += a[q] * x.d[q] * static_cast<float>(piece_dot(c[q], x.q[q], -32 * x.sum[q]));
    }
    return s;
  }
};

}  // namespace candle_vllm::gguf
