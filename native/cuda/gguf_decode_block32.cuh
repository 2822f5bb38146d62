// The decoders (Deq) of the 32-element GGUF types: a unit is 8 blocks, step s is block s.
#pragma once
#include "cuda/gguf_block.cuh"

namespace candle_vllm::gguf {

// Shared by Q4_0/Q4_1/Q5_0/Q5_1: lane t holds qs bytes 4t..4t+3, whose low nibbles are elements 4t..4t+3 and
// high nibbles elements 16+4t..16+4t+3.
GGUF_HD int legacy_nibble_elem(int s, int t, int j) { return 32 * s + 4 * t + 2 * (j & 1) + 16 * (j >> 1); }

GGUF_HD void legacy_nibble_codes(const uint8_t* qs, int t, uint32_t (&c)[4]) {
  const uint32_t v = ld32(qs + 4 * t), p01 = spread(v, 0), p23 = spread(v, 2);
  c[0] = p01 & kLo4;
  c[1] = p23 & kLo4;
  c[2] = (p01 >> 4) & kLo4;
  c[3] = (p23 >> 4) & kLo4;
}

// The fifth bit of the pair of elements (e, e+1), from the block's 32-bit qh word.
GGUF_HD uint32_t legacy_high_bits(uint32_t qh, int e) { return (((qh >> e) & 1) << 4) | (((qh >> (e + 1)) & 1) << 20); }

template <>
struct Deq<Q4_0> {
  static constexpr int kBlockElems = 32, kBlockBytes = 18, kOffset = 8, kCodeBits = 4;
  static constexpr bool kScalesPerStep = true;
  GGUF_HD static void slice(const uint8_t* b, int, float (&v)[32]) {
    const float d = f16(b);
    for (int i = 0; i < 16; ++i) {
      v[i] = mul_rn(d, static_cast<float>((b[2 + i] & 0x0F) - 8));
      v[16 + i] = mul_rn(d, static_cast<float>((b[2 + i] >> 4) - 8));
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return legacy_nibble_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    legacy_nibble_codes(u + s * kBlockBytes + 2, t, c);
  }
  GGUF_HD static void scales(const uint8_t* u, int s, int, float (&a)[4], float (&b)[4]) {
    const float d = f16(u + s * kBlockBytes);
    for (int j = 0; j < 4; ++j) a[j] = d, b[j] = 0.f;
  }
};

template <>
struct Deq<Q4_1> {
  static constexpr int kBlockElems = 32, kBlockBytes = 20, kOffset = 0, kCodeBits = 4;
  static constexpr bool kScalesPerStep = true;
  GGUF_HD static void slice(const uint8_t* b, int, float (&v)[32]) {
    const float d = f16(b), m = f16(b + 2);
    for (int i = 0; i < 16; ++i) {
      v[i] = add_rn(mul_rn(d, static_cast<float>(b[4 + i] & 0x0F)), m);
      v[16 + i] = add_rn(mul_rn(d, static_cast<float>(b[4 + i] >> 4)), m);
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return legacy_nibble_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    legacy_nibble_codes(u + s * kBlockBytes + 4, t, c);
  }
  GGUF_HD static void scales(const uint8_t* u, int s, int, float (&a)[4], float (&b)[4]) {
    const float d = f16(u + s * kBlockBytes), m = f16(u + s * kBlockBytes + 2);
    for (int j = 0; j < 4; ++j) a[j] = d, b[j] = m;
  }
};

// Q5_0 and Q8_0 in the CUDA layout (gguf_block.cuh): p, u + s kBlockBytes are GGUF positions, the codes at
// grouped_body, d and qh in the group's header.
template <>
struct Deq<Q5_0> {
  static constexpr int kBlockElems = 32, kBlockBytes = 22, kOffset = 16, kCodeBits = 5;
  static constexpr bool kScalesPerStep = true;
  GGUF_HD static void slice(const uint8_t* p, int, float (&v)[32]) {
    const float d = f16(grouped_field<Q5_0>(p, kBlock32D));
    const uint32_t qh = ld32(grouped_field<Q5_0>(p, kQ5_0Qh));
    const uint8_t* qs = grouped_body<Q5_0>(p);
    for (int i = 0; i < 32; ++i) {
      const int q = ((qs[i & 15] >> (4 * (i >> 4))) & 0x0F) | (((qh >> i) & 1) << 4);
      v[i] = mul_rn(d, static_cast<float>(q - 16));
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return legacy_nibble_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    const uint8_t* p = u + s * kBlockBytes;
    legacy_nibble_codes(grouped_body<Q5_0>(p), t, c);
    const uint32_t qh = ld32(grouped_field<Q5_0>(p, kQ5_0Qh));
    for (int j = 0; j < 4; ++j) c[j] |= legacy_high_bits(qh, elem(0, t, j));
  }
  GGUF_HD static void scales(const uint8_t* u, int s, int, float (&a)[4], float (&b)[4]) {
    const float d = f16(grouped_field<Q5_0>(u + s * kBlockBytes, kBlock32D));
    for (int j = 0; j < 4; ++j) a[j] = d, b[j] = 0.f;
  }
};

template <>
struct Deq<Q5_1> {
  static constexpr int kBlockElems = 32, kBlockBytes = 24, kOffset = 0, kCodeBits = 5;
  static constexpr bool kScalesPerStep = true;
  GGUF_HD static void slice(const uint8_t* b, int, float (&v)[32]) {
    const float d = f16(b), m = f16(b + 2);
    const uint32_t qh = ld32(b + 4);
    for (int i = 0; i < 32; ++i) {
      const int q = ((b[8 + (i & 15)] >> (4 * (i >> 4))) & 0x0F) | (((qh >> i) & 1) << 4);
      v[i] = add_rn(mul_rn(d, static_cast<float>(q)), m);
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return legacy_nibble_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    const uint8_t* b = u + s * kBlockBytes;
    legacy_nibble_codes(b + 8, t, c);
    const uint32_t qh = ld32(b + 4);
    for (int j = 0; j < 4; ++j) c[j] |= legacy_high_bits(qh, elem(0, t, j));
  }
  GGUF_HD static void scales(const uint8_t* u, int s, int, float (&a)[4], float (&b)[4]) {
    const float d = f16(u + s * kBlockBytes), m = f16(u + s * kBlockBytes + 2);
    for (int j = 0; j < 4; ++j) a[j] = d, b[j] = m;
  }
};

template <>
struct Deq<Q8_0> {
  static constexpr int kBlockElems = 32, kBlockBytes = 34, kOffset = 128, kCodeBits = 8;
  static constexpr bool kScalesPerStep = true;
  GGUF_HD static void slice(const uint8_t* p, int, float (&v)[32]) {
    const float d = f16(grouped_field<Q8_0>(p, kBlock32D));
    const uint8_t* qs = grouped_body<Q8_0>(p);
    for (int i = 0; i < 32; ++i) v[i] = mul_rn(static_cast<float>(static_cast<int8_t>(qs[i])), d);
  }
  // Lane t: bytes 8t..8t+7; codes are the int8 values plus 128.
  GGUF_HD static int elem(int s, int t, int j) { return 32 * s + 8 * t + 2 * j; }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    const uint8_t* qs = grouped_body<Q8_0>(u + s * kBlockBytes) + 8 * t;
    for (int j = 0; j < 4; ++j) c[j] = spread(ld16(qs + 2 * j), 0) ^ 0x00800080u;
  }
  GGUF_HD static void scales(const uint8_t* u, int s, int, float (&a)[4], float (&b)[4]) {
    const float d = f16(grouped_field<Q8_0>(u + s * kBlockBytes, kBlock32D));
    for (int j = 0; j < 4; ++j) a[j] = d, b[j] = 0.f;
  }
};

}  // namespace candle_vllm::gguf
