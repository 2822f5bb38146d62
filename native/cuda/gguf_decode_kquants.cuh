// The decoders (Deq) of the 256-element GGUF K-quants: a unit is one block; scales() is called once per block.
#pragma once
#include "cuda/gguf_block.cuh"

namespace candle_vllm::gguf {

// Q4_K/Q5_K: 6-bit scale and min of sub-block j from the 12 packed bytes.
GGUF_HD void k4_scale_min(const uint8_t* q, int j, int& sc, int& m) {
  const int b = q[j < 4 ? j : j + 4];  // j < 4: the scale's byte; else the byte of packed low nibbles
  sc = j < 4 ? b & 63 : (b & 0x0F) | ((q[j - 4] >> 6) << 4);
  m = j < 4 ? q[j + 4] & 63 : (b >> 4) | ((q[j] >> 6) << 4);
}

// Q3_K: signed 6-bit scale k (0..15) from the 12 packed bytes.
GGUF_HD int q3k_scale(const uint8_t* q, int k) {
  const int lo = k < 8 ? (q[k] & 0x0F) : (q[k - 8] >> 4);
  const int hi = (q[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
  return (lo | (hi << 4)) - 32;
}

// Q2_K/Q3_K/Q6_K: lane t covers half h = t/2 of the block and, in step s, positions l = 16(t%2) + 2s, +1 of the
// four 32-element rows j of that half: element 128h + 32j + l, scale index 8h + 2j + t%2.
GGUF_HD int k_plane_elem(int s, int t, int j) { return 128 * (t >> 1) + 32 * j + 16 * (t & 1) + 2 * s; }
GGUF_HD int k_plane_scale(int t, int j) { return 8 * (t >> 1) + 2 * j + (t & 1); }

template <>
struct Deq<Q2_K> {
  static constexpr int kBlockElems = 256, kBlockBytes = 84, kOffset = 0, kCodeBits = 2;
  static constexpr bool kScalesPerStep = false;
  GGUF_HD static void slice(const uint8_t* b, int s, float (&v)[32]) {
    const float d = f16(b + 80), dmin = f16(b + 82);
    const uint8_t* qs = b + 16 + 32 * (s >> 2);
    for (int i = 0; i < 32; ++i) {
      const int sc = b[2 * s + (i >> 4)];
      const float dl = mul_rn(d, static_cast<float>(sc & 0x0F)), ml = mul_rn(dmin, static_cast<float>(sc >> 4));
      v[i] = sub_rn(mul_rn(dl, static_cast<float>((qs[i] >> (2 * (s & 3))) & 3)), ml);
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return k_plane_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    const uint32_t p = spread(ld16(u + 16 + 32 * (t >> 1) + 16 * (t & 1) + 2 * s), 0);
    for (int j = 0; j < 4; ++j) c[j] = (p >> (2 * j)) & kLo2;
  }
  GGUF_HD static void scales(const uint8_t* u, int, int t, float (&a)[4], float (&b)[4]) {
    const float d = f16(u + 80), dmin = f16(u + 82);
    for (int j = 0; j < 4; ++j) {
      const int sc = u[k_plane_scale(t, j)];
      a[j] = d * static_cast<float>(sc & 0x0F);
      b[j] = -(dmin * static_cast<float>(sc >> 4));
    }
  }
};

// Q3_K in the CUDA layout (gguf_block.cuh): p is the block's GGUF position, its bytes at grouped_body / grouped_field.
template <>
struct Deq<Q3_K> {
  static constexpr int kBlockElems = 256, kBlockBytes = 110, kOffset = 4, kCodeBits = 3;
  static constexpr bool kScalesPerStep = false;
  GGUF_HD static void slice(const uint8_t* p, int s, float (&v)[32]) {
    const uint8_t *b = grouped_body<Q3_K>(p), *sc = grouped_field<Q3_K>(p, kQ3KScales);
    const float d = f16(grouped_field<Q3_K>(p, kQ3KD));
    const uint8_t* qs = b + 32 + 32 * (s >> 2);
    for (int i = 0; i < 32; ++i) {
      const float dl = mul_rn(d, static_cast<float>(q3k_scale(sc, 2 * s + (i >> 4))));
      const int q = ((qs[i] >> (2 * (s & 3))) & 3) - 4 * (1 - ((b[i] >> s) & 1));
      v[i] = mul_rn(dl, static_cast<float>(q));
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return k_plane_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* p, int s, int t, uint32_t (&c)[4]) {
    const uint8_t* u = grouped_body<Q3_K>(p);
    const int l = 16 * (t & 1) + 2 * s, h = t >> 1;
    const uint32_t q = spread(ld16(u + 32 + 32 * h + l), 0), hm = spread(ld16(u + l), 0);
    for (int j = 0; j < 4; ++j) c[j] = ((q >> (2 * j)) & kLo2) | (((hm >> (4 * h + j)) & kLo1) << 2);
  }
  GGUF_HD static void scales(const uint8_t* p, int, int t, float (&a)[4], float (&b)[4]) {
    const uint8_t* sc = grouped_field<Q3_K>(p, kQ3KScales);
    const float d = f16(grouped_field<Q3_K>(p, kQ3KD));
    for (int j = 0; j < 4; ++j) a[j] = d * static_cast<float>(q3k_scale(sc, k_plane_scale(t, j))), b[j] = 0.f;
  }
};

// Q4_K/Q5_K: lane t covers qs bytes 32t..32t+31 (sub-blocks 2t in the low nibbles, 2t+1 in the high ones); in
// step s, bytes 32t+4s..+3.
GGUF_HD int k4_elem(int s, int t, int j) { return 64 * t + 4 * s + 2 * (j & 1) + 32 * (j >> 1); }

GGUF_HD void k4_scales(const uint8_t* u, int t, float (&a)[4], float (&b)[4]) {
  const float d = f16(u), dmin = f16(u + 2);
  for (int h = 0; h < 2; ++h) {
    int sc, m;
    k4_scale_min(u + 4, 2 * t + h, sc, m);
    a[2 * h] = a[2 * h + 1] = d * static_cast<float>(sc);
    b[2 * h] = b[2 * h + 1] = -(dmin * static_cast<float>(m));
  }
}

GGUF_HD void k4_slice(const uint8_t* b, const uint8_t* qs, int s, int (&q)[32], float& dd, float& dm) {
  const float d = f16(b), dmin = f16(b + 2);
  int sc, m;
  k4_scale_min(b + 4, s, sc, m);
  dd = mul_rn(d, static_cast<float>(sc));
  dm = mul_rn(dmin, static_cast<float>(m));
  for (int i = 0; i < 32; ++i) q[i] = (qs[32 * (s >> 1) + i] >> (4 * (s & 1))) & 0x0F;
}

template <>
struct Deq<Q4_K> {
  static constexpr int kBlockElems = 256, kBlockBytes = 144, kOffset = 0, kCodeBits = 4;
  static constexpr bool kScalesPerStep = false;
  GGUF_HD static void slice(const uint8_t* b, int s, float (&v)[32]) {
    int q[32];
    float dd, dm;
    k4_slice(b, b + 16, s, q, dd, dm);
    for (int i = 0; i < 32; ++i) v[i] = sub_rn(mul_rn(dd, static_cast<float>(q[i])), dm);
  }
  GGUF_HD static int elem(int s, int t, int j) { return k4_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    legacy_nibble_codes(u + 16 + 32 * t + 4 * s, 0, c);
  }
  GGUF_HD static void scales(const uint8_t* u, int, int t, float (&a)[4], float (&b)[4]) { k4_scales(u, t, a, b); }
};

template <>
struct Deq<Q5_K> {
  static constexpr int kBlockElems = 256, kBlockBytes = 176, kOffset = 0, kCodeBits = 5;
  static constexpr bool kScalesPerStep = false;
  GGUF_HD static void slice(const uint8_t* b, int s, float (&v)[32]) {
    int q[32];
    float dd, dm;
    k4_slice(b, b + 48, s, q, dd, dm);
    for (int i = 0; i < 32; ++i) {
      const int code = q[i] | (((b[16 + i] >> s) & 1) << 4);
      v[i] = sub_rn(mul_rn(dd, static_cast<float>(code)), dm);
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return k4_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    legacy_nibble_codes(u + 48 + 32 * t + 4 * s, 0, c);
    const uint32_t qh = ld32(u + 16 + 4 * s), h01 = spread(qh, 0), h23 = spread(qh, 2);
    c[0] |= ((h01 >> (2 * t)) & kLo1) << 4;
    c[1] |= ((h23 >> (2 * t)) & kLo1) << 4;
    c[2] |= ((h01 >> (2 * t + 1)) & kLo1) << 4;
    c[3] |= ((h23 >> (2 * t + 1)) & kLo1) << 4;
  }
  GGUF_HD static void scales(const uint8_t* u, int, int t, float (&a)[4], float (&b)[4]) { k4_scales(u, t, a, b); }
};

// Q6_K in the CUDA layout (gguf_block.cuh): p is the block's GGUF position, its bytes at grouped_body / grouped_field.
template <>
struct Deq<Q6_K> {
  static constexpr int kBlockElems = 256, kBlockBytes = 210, kOffset = 32, kCodeBits = 6;
  static constexpr bool kScalesPerStep = false;
  GGUF_HD static void slice(const uint8_t* p, int s, float (&v)[32]) {
    const uint8_t* b = grouped_body<Q6_K>(p);
    const float d = f16(grouped_field<Q6_K>(p, kQ6KD));
    const int h = s >> 2, r = 32 * (s & 3);
    for (int i = 0; i < 32; ++i) {
      const float dd = mul_rn(d, static_cast<float>(static_cast<int8_t>(b[192 + 2 * s + (i >> 4)])));
      const int lo = (b[64 * h + ((r + i) & 63)] >> (4 * ((r + i) >> 6))) & 0x0F;
      const int hi = (b[128 + 32 * h + i] >> (2 * (s & 3))) & 3;
      v[i] = mul_rn(dd, static_cast<float>((lo | (hi << 4)) - 32));
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return k_plane_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* p, int s, int t, uint32_t (&c)[4]) {
    const uint8_t* u = grouped_body<Q6_K>(p);
    const int l = 16 * (t & 1) + 2 * s, h = t >> 1;
    const uint32_t ql0 = spread(ld16(u + 64 * h + l), 0), ql1 = spread(ld16(u + 64 * h + 32 + l), 0);
    const uint32_t qh = spread(ld16(u + 128 + 32 * h + l), 0);
    c[0] = (ql0 & kLo4) | ((qh & kLo2) << 4);
    c[1] = (ql1 & kLo4) | (((qh >> 2) & kLo2) << 4);
    c[2] = ((ql0 >> 4) & kLo4) | (((qh >> 4) & kLo2) << 4);
    c[3] = ((ql1 >> 4) & kLo4) | (((qh >> 6) & kLo2) << 4);
  }
  GGUF_HD static void scales(const uint8_t* p, int, int t, float (&a)[4], float (&b)[4]) {
    const uint8_t* u = grouped_body<Q6_K>(p);
    const float d = f16(grouped_field<Q6_K>(p, kQ6KD));
    for (int j = 0; j < 4; ++j)
      a[j] = d * static_cast<float>(static_cast<int8_t>(u[192 + k_plane_scale(t, j)])), b[j] = 0.f;
  }
};

}  // namespace candle_vllm::gguf
