// GGUF (ggml) block decoding shared by the CUDA dequantize and fused GEMV kernels.
//
// Two decoders per type, both plain integer/float code that also compiles on the host (so the bit layouts can be
// checked against the `gguf` package without a GPU):
//  - Deq<Q>::slice: 32 consecutive elements of a block as f32, with gguf's own order of f32 operations (each
//    product and sum rounded separately), so a dequantized f32 tensor equals gguf.quants.dequantize exactly.
//  - Deq<Q>::codes / elem / scales: the GEMV's view. A warp's lane t (of the 4 lanes sharing a weight row in an
//    mma fragment) takes, in each 32-element step s of a 256-element unit, 4 pairs of adjacent elements. codes()
//    returns each pair's two unsigned codes at bits 0 and 16 of a word, elem() the pair's first element within
//    the unit, and scales() an (a, b) per pair so that w = (code - kOffset) * a + b. Adjacent elements let the
//    activations be fetched as aligned 4-byte pairs; the pairs are picked so each lane needs few scales per block.
// A unit is 8 blocks of the 32-element types and one block of the 256-element (K) types.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define GGUF_HD __host__ __device__ __forceinline__
#else
#define GGUF_HD inline
#endif

namespace candle_vllm::gguf {

// gguf's GGMLQuantizationType values.
enum QType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int kUnitElems = 256;

// ---- exact f32 helpers (no FMA contraction, even under --use_fast_math) --------------------------------------

GGUF_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GGUF_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GGUF_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

GGUF_HD uint32_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
// A 32-bit word at a 2-byte aligned address.
GGUF_HD uint32_t ld32(const uint8_t* p) { return ld16(p) | (ld16(p + 2) << 16); }

GGUF_HD float f16(const uint8_t* p) {
  const uint32_t h = ld16(p);
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&v, &bits, 4);
  return v;
#endif
}

// Bytes k and k+1 of v moved to bytes 0 and 2 (the two halves of a packed pair).
GGUF_HD uint32_t spread(uint32_t v, int k) {
#ifdef __CUDA_ARCH__
  return __byte_perm(v, 0, k == 0 ? 0x4140 : 0x4342);
#else
  return ((v >> (8 * k)) & 0xFF) | (((v >> (8 * k + 8)) & 0xFF) << 16);
#endif
}

constexpr uint32_t kLo4 = 0x000F000F, kLo2 = 0x00030003, kLo1 = 0x00010001;

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

template <int Q>
struct Deq;

// ---- 32-element types: a unit is 8 blocks, step s is block s ----------------------------------------------

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

template <>
struct Deq<Q5_0> {
  static constexpr int kBlockElems = 32, kBlockBytes = 22, kOffset = 16, kCodeBits = 5;
  static constexpr bool kScalesPerStep = true;
  GGUF_HD static void slice(const uint8_t* b, int, float (&v)[32]) {
    const float d = f16(b);
    const uint32_t qh = ld32(b + 2);
    for (int i = 0; i < 32; ++i) {
      const int q = ((b[6 + (i & 15)] >> (4 * (i >> 4))) & 0x0F) | (((qh >> i) & 1) << 4);
      v[i] = mul_rn(d, static_cast<float>(q - 16));
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return legacy_nibble_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    const uint8_t* b = u + s * kBlockBytes;
    legacy_nibble_codes(b + 6, t, c);
    const uint32_t qh = ld32(b + 2);
    for (int j = 0; j < 4; ++j) c[j] |= legacy_high_bits(qh, elem(0, t, j));
  }
  GGUF_HD static void scales(const uint8_t* u, int s, int, float (&a)[4], float (&b)[4]) {
    const float d = f16(u + s * kBlockBytes);
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
  GGUF_HD static void slice(const uint8_t* b, int, float (&v)[32]) {
    const float d = f16(b);
    for (int i = 0; i < 32; ++i) v[i] = mul_rn(static_cast<float>(static_cast<int8_t>(b[2 + i])), d);
  }
  // Lane t: bytes 8t..8t+7; codes are the int8 values plus 128.
  GGUF_HD static int elem(int s, int t, int j) { return 32 * s + 8 * t + 2 * j; }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    const uint8_t* qs = u + s * kBlockBytes + 2 + 8 * t;
    for (int j = 0; j < 4; ++j) c[j] = spread(ld16(qs + 2 * j), 0) ^ 0x00800080u;
  }
  GGUF_HD static void scales(const uint8_t* u, int s, int, float (&a)[4], float (&b)[4]) {
    const float d = f16(u + s * kBlockBytes);
    for (int j = 0; j < 4; ++j) a[j] = d, b[j] = 0.f;
  }
};

// ---- 256-element (K) types: a unit is one block; scales() is called once per block ---------------------------

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

template <>
struct Deq<Q3_K> {
  static constexpr int kBlockElems = 256, kBlockBytes = 110, kOffset = 4, kCodeBits = 3;
  static constexpr bool kScalesPerStep = false;
  GGUF_HD static void slice(const uint8_t* b, int s, float (&v)[32]) {
    const float d = f16(b + 108);
    const uint8_t* qs = b + 32 + 32 * (s >> 2);
    for (int i = 0; i < 32; ++i) {
      const float dl = mul_rn(d, static_cast<float>(q3k_scale(b + 96, 2 * s + (i >> 4))));
      const int q = ((qs[i] >> (2 * (s & 3))) & 3) - 4 * (1 - ((b[i] >> s) & 1));
      v[i] = mul_rn(dl, static_cast<float>(q));
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return k_plane_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    const int l = 16 * (t & 1) + 2 * s, h = t >> 1;
    const uint32_t p = spread(ld16(u + 32 + 32 * h + l), 0), hm = spread(ld16(u + l), 0);
    for (int j = 0; j < 4; ++j) c[j] = ((p >> (2 * j)) & kLo2) | (((hm >> (4 * h + j)) & kLo1) << 2);
  }
  GGUF_HD static void scales(const uint8_t* u, int, int t, float (&a)[4], float (&b)[4]) {
    const float d = f16(u + 108);
    for (int j = 0; j < 4; ++j) a[j] = d * static_cast<float>(q3k_scale(u + 96, k_plane_scale(t, j))), b[j] = 0.f;
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

template <>
struct Deq<Q6_K> {
  static constexpr int kBlockElems = 256, kBlockBytes = 210, kOffset = 32, kCodeBits = 6;
  static constexpr bool kScalesPerStep = false;
  GGUF_HD static void slice(const uint8_t* b, int s, float (&v)[32]) {
    const float d = f16(b + 208);
    const int h = s >> 2, r = 32 * (s & 3);
    for (int i = 0; i < 32; ++i) {
      const float dd = mul_rn(d, static_cast<float>(static_cast<int8_t>(b[192 + 2 * s + (i >> 4)])));
      const int lo = (b[64 * h + ((r + i) & 63)] >> (4 * ((r + i) >> 6))) & 0x0F;
      const int hi = (b[128 + 32 * h + i] >> (2 * (s & 3))) & 3;
      v[i] = mul_rn(dd, static_cast<float>((lo | (hi << 4)) - 32));
    }
  }
  GGUF_HD static int elem(int s, int t, int j) { return k_plane_elem(s, t, j); }
  GGUF_HD static void codes(const uint8_t* u, int s, int t, uint32_t (&c)[4]) {
    const int l = 16 * (t & 1) + 2 * s, h = t >> 1;
    const uint32_t ql0 = spread(ld16(u + 64 * h + l), 0), ql1 = spread(ld16(u + 64 * h + 32 + l), 0);
    const uint32_t qh = spread(ld16(u + 128 + 32 * h + l), 0);
    c[0] = (ql0 & kLo4) | ((qh & kLo2) << 4);
    c[1] = (ql1 & kLo4) | (((qh >> 2) & kLo2) << 4);
    c[2] = ((ql0 >> 4) & kLo4) | (((qh >> 4) & kLo2) << 4);
    c[3] = ((ql1 >> 4) & kLo4) | (((qh >> 6) & kLo2) << 4);
  }
  GGUF_HD static void scales(const uint8_t* u, int, int t, float (&a)[4], float (&b)[4]) {
    const float d = f16(u + 208);
    for (int j = 0; j < 4; ++j)
      a[j] = d * static_cast<float>(static_cast<int8_t>(u[192 + k_plane_scale(t, j)])), b[j] = 0.f;
  }
};

// Calls f(Deq<Q>{}) for a runtime type code; returns false for codes without a decoder.
template <typename F>
GGUF_HD bool dispatch_qtype(int q, F&& f) {
  switch (q) {
    case Q4_0: f(Deq<Q4_0>{}); return true;
    case Q4_1: f(Deq<Q4_1>{}); return true;
    case Q5_0: f(Deq<Q5_0>{}); return true;
    case Q5_1: f(Deq<Q5_1>{}); return true;
    case Q8_0: f(Deq<Q8_0>{}); return true;
    case Q2_K: f(Deq<Q2_K>{}); return true;
    case Q3_K: f(Deq<Q3_K>{}); return true;
    case Q4_K: f(Deq<Q4_K>{}); return true;
    case Q5_K: f(Deq<Q5_K>{}); return true;
    case Q6_K: f(Deq<Q6_K>{}); return true;
    default: return false;
  }
}

}  // namespace candle_vllm::gguf
