// Per-block GGUF quantizers shared by the CPU (quant_quantize.cpp) and CUDA (cuda/isq_quantize.cu) ISQ kernels,
// so both produce the same bytes. They follow llama.cpp's reference quantizers (quantize_row_*_ref in
// ggml-quants.c, no importance matrix), the quantizer behind `llama-quantize` and the gguf package: the same
// searches, the same f32 operation order, round-half-even `nearest_int` where ggml uses it, truncation of
// x + 0.5 for Q4_0/Q4_1/Q5_0/Q5_1 and round-half-away for Q8_0.
//
// All f32 arithmetic goes through the mul/add/sub/div/sqrt_ helpers: on the device they are IEEE-rounded PTX
// instructions that keep subnormals (the CUDA build uses --use_fast_math, which would approximate division and
// sqrt, fuse multiply-adds and flush subnormals); on the host the translation unit is compiled without
// multiply-add contraction (see quant_quantize.cpp). Only inputs that are themselves f32 subnormals
// (|x| < 1.2e-38) may compare differently on the device, where comparisons and fabsf flush them.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ISQ_HD __host__ __device__ __forceinline__
#else
#define ISQ_HD inline
#endif

namespace candle_vllm::isq {

constexpr int QK = 32;
constexpr int QKK = 256;
constexpr float GROUP_MAX_EPS = 1e-15f;

// On the device, explicit PTX without .ftz: --use_fast_math would otherwise flush subnormal products (e.g. the
// x^8-sized terms of the Q3_K/Q6_K searches over 1e-5-sized weights) and diverge from the host.
#if defined(__CUDA_ARCH__)
#define ISQ_PTX2(op, a, b)                                                  \
  float r;                                                                  \
  asm(op " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                        \
  return r
#endif

ISQ_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  ISQ_PTX2("mul.rn.f32", a, b);
#else
  return a * b;
#endif
}
ISQ_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  ISQ_PTX2("add.rn.f32", a, b);
#else
  return a + b;
#endif
}
ISQ_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  ISQ_PTX2("sub.rn.f32", a, b);
#else
  return a - b;
#endif
}
ISQ_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  ISQ_PTX2("div.rn.f32", a, b);
#else
  return a / b;
#endif
}
ISQ_HD float sqrt_(float a) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
#else
  return sqrtf(a);
#endif
}

ISQ_HD uint32_t bits_of(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}
ISQ_HD float float_of(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

// Round half to even for |f| <= 2^22: adding 1.5 * 2^23 leaves the integer in the low mantissa bits.
ISQ_HD int nearest_int(float f) {
  const uint32_t b = bits_of(add(f, 12582912.f));
  return static_cast<int>(b & 0x007fffffu) - 0x00400000;
}

// f32 -> IEEE half bits, round to nearest even (subnormals included), as F16C's vcvtps2ph does.
ISQ_HD uint16_t to_half(float f) {
  const uint32_t x = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity
  if (a >= 0x38800000u) {                       // normal half
    const uint32_t r = a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u);
    return sign | static_cast<uint16_t>(r >> 13);
  }
  if (a < 0x33000000u) return sign;             // below half the smallest subnormal: zero
  const uint32_t mant = (a & 0x007fffffu) | 0x00800000u;
  const int shift = 126 - static_cast<int>(a >> 23);  // value in units of 2^-24 is mant >> shift
  uint32_t q = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

ISQ_HD float from_half(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in f32
    const float v = static_cast<float>(m) * 5.9604644775390625e-08f;
    return float_of(bits_of(v) | sign);
  }
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

ISQ_HD void put_half(uint8_t* p, float f) {
  const uint16_t h = to_half(f);
  p[0] = static_cast<uint8_t>(h & 0xff);
  p[1] = static_cast<uint8_t>(h >> 8);
}
ISQ_HD float get_half(const uint8_t* p) { return from_half(static_cast<uint16_t>(p[0] | (p[1] << 8))); }

ISQ_HD int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The element of largest magnitude (the first one on ties), with its sign.
ISQ_HD float signed_absmax(const float* x, int n, float& amax) {
  float max = 0.f;
  amax = 0.f;
  for (int i = 0; i < n; ++i) {
    const float ax = fabsf(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  return max;
}

// ---- the scale searches (ggml's make_qx_quants / make_q3_quants / make_qkx2_quants) ----

// Symmetric codes l = clamp(nearest(iscale * x), -nmax, nmax-1), stored as l + offset when L is given, and their
// sums with weights w = x^2: slx = sum w x l, sl2 = sum w l^2.
ISQ_HD void symmetric_codes(int n, int nmax, const float* x, float iscale, int8_t* L, int offset, float& slx,
                            float& sl2) {
  slx = 0.f;
  sl2 = 0.f;
  for (int i = 0; i < n; ++i) {
    const int l = clampi(nearest_int(mul(iscale, x[i])), -nmax, nmax - 1);
    if (L) L[i] = static_cast<int8_t>(l + offset);
    const float w = mul(x[i], x[i]);
    const float fl = static_cast<float>(l);
    slx = add(slx, mul(mul(w, x[i]), fl));
    sl2 = add(sl2, mul(mul(w, fl), fl));
  }
}

// The signed value of largest magnitude, or 0 with all codes 0 when the block is (nearly) all zero.
ISQ_HD float symmetric_max(int n, const float* x, int8_t* L) {
  float amax;
  const float max = signed_absmax(x, n, amax);
  if (amax >= GROUP_MAX_EPS) return max;
  for (int i = 0; i < n; ++i) L[i] = 0;
  return 0.f;
}

// Symmetric codes (stored +nmax): the start scale -nmax/max and 18 nearby ones; keeps the scale maximising
// (sum w x l)^2 / (sum w l^2) with w = x^2, i.e. the least-squares optimum per code set.
ISQ_HD float fit_symmetric(int n, int nmax, const float* x, int8_t* L) {
  const float max = symmetric_max(n, x, L);
  if (max == 0.f) return 0.f;
  float sumlx, suml2;
  symmetric_codes(n, nmax, x, div(static_cast<float>(-nmax), max), L, nmax, sumlx, suml2);
  float scale = suml2 != 0.f ? div(sumlx, suml2) : 0.f;
  float best = mul(scale, sumlx);
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    const float iscale = div(-add(static_cast<float>(nmax), mul(0.1f, static_cast<float>(is))), max);
    float slx, sl2;
    symmetric_codes(n, nmax, x, iscale, nullptr, 0, slx, sl2);
    if (sl2 > 0.f && mul(slx, slx) > mul(best, sl2)) {
      symmetric_codes(n, nmax, x, iscale, L, nmax, slx, sl2);
      scale = div(slx, sl2);
      best = mul(scale, slx);
    }
  }
  return scale;
}

// Q3_K's symmetric fit: start at -nmax/max, then up to 5 passes moving single codes while that raises
// (sum w x l)^2 / (sum w l^2) with w = x^2; returns the least-squares scale of the final codes.
ISQ_HD float fit_symmetric_iterative(int n, int nmax, const float* x, int8_t* L) {
  const float max = symmetric_max(n, x, L);
  if (max == 0.f) return 0.f;
  float sumlx, suml2;
  symmetric_codes(n, nmax, x, div(static_cast<float>(-nmax), max), L, 0, sumlx, suml2);
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = mul(x[i], x[i]);
      const float li = static_cast<float>(L[i]);
      float slx = sub(sumlx, mul(mul(w, x[i]), li));
      if (!(slx > 0.f)) continue;
      float sl2 = sub(suml2, mul(mul(w, li), li));
      const int nl = clampi(nearest_int(div(mul(x[i], sl2), slx)), -nmax, nmax - 1);
      if (nl == L[i]) continue;
      const float fnl = static_cast<float>(nl);
      slx = add(slx, mul(mul(w, x[i]), fnl));
      sl2 = add(sl2, mul(mul(w, fnl), fnl));
      if (sl2 > 0.f && mul(mul(slx, slx), suml2) > mul(mul(sumlx, sumlx), sl2)) {
        L[i] = static_cast<int8_t>(nl);
        sumlx = slx;
        suml2 = sl2;
        ++changed;
      }
    }
    if (!changed) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(L[i] + nmax);
  return suml2 > 0.f ? div(sumlx, suml2) : 0.f;
}

// Asymmetric codes l in [0, nmax] for x ~ scale * l - the_min: tries nstep+1 inverse scales
// (rmin + rdelta*is + nmax) / (max - min), solves the weighted least-squares scale and offset for each code set
// (min clamped to <= 0) and keeps the one with the least weighted absolute (use_mad) or squared error.
ISQ_HD float fit_scale_min(int n, int nmax, const float* x, const float* w, uint8_t* L, float* the_min,
                           uint8_t* Laux, float rmin, float rdelta, int nstep, bool use_mad) {
  float min = x[0], max = x[0];
  float sum_w = w[0];
  float sum_x = mul(sum_w, x[0]);
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w = add(sum_w, w[i]);
    sum_x = add(sum_x, mul(w[i], x[i]));
  }
  if (min > 0.f) min = 0.f;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  auto error = [&](float scale, float offset, const uint8_t* codes) {
    float e = 0.f;
    for (int i = 0; i < n; ++i) {
      float diff = sub(add(mul(scale, static_cast<float>(codes[i])), offset), x[i]);
      diff = use_mad ? fabsf(diff) : mul(diff, diff);
      e = add(e, mul(w[i], diff));
    }
    return e;
  };
  float iscale = div(static_cast<float>(nmax), sub(max, min));
  float scale = div(1.f, iscale);
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(clampi(nearest_int(mul(iscale, sub(x[i], min))), 0, nmax));
  float best_error = error(scale, min, L);
  for (int is = 0; is <= nstep; ++is) {
    // min is the best offset so far: later candidates are centred on it, as in ggml.
    iscale = div(add(add(rmin, mul(rdelta, static_cast<float>(is))), static_cast<float>(nmax)), sub(max, min));
    float sum_l = 0.f, sum_l2 = 0.f, sum_xl = 0.f;
    for (int i = 0; i < n; ++i) {
      const int l = clampi(nearest_int(mul(iscale, sub(x[i], min))), 0, nmax);
      Laux[i] = static_cast<uint8_t>(l);
      const float wl = mul(w[i], static_cast<float>(l));
      sum_l = add(sum_l, wl);
      sum_l2 = add(sum_l2, mul(wl, static_cast<float>(l)));
      sum_xl = add(sum_xl, mul(wl, x[i]));
    }
    const float D = sub(mul(sum_w, sum_l2), mul(sum_l, sum_l));
    if (!(D > 0.f)) continue;
    float this_scale = div(sub(mul(sum_w, sum_xl), mul(sum_x, sum_l)), D);
    float this_min = div(sub(mul(sum_l2, sum_x), mul(sum_l, sum_xl)), D);
    if (this_min > 0.f) {
      this_min = 0.f;
      this_scale = div(sum_xl, sum_l2);
    }
    const float cur = error(this_scale, this_min, Laux);
    if (cur < best_error) {
      for (int i = 0; i < n; ++i) L[i] = Laux[i];
      best_error = cur;
      scale = this_scale;
      min = this_min;
    }
  }
  *the_min = -min;
  return scale;
}

// ---- 32-element blocks ----

ISQ_HD void pack_nibbles(const uint8_t* q, uint8_t* qs) {  // element j low nibble, element j+16 high nibble
  for (int j = 0; j < QK / 2; ++j) qs[j] = static_cast<uint8_t>(q[j] | (q[j + QK / 2] << 4));
}

ISQ_HD void pack_fifth_bits(const uint8_t* q, uint8_t* qh) {  // bit 4 of element j -> bit j of a LE u32
  uint32_t h = 0;
  for (int j = 0; j < QK; ++j) h |= static_cast<uint32_t>((q[j] >> 4) & 1u) << j;
  for (int b = 0; b < 4; ++b) qh[b] = static_cast<uint8_t>(h >> (8 * b));
}

// Q4_0 / Q5_0: d = max / -2^(bits-1) from the signed absolute maximum, q = trunc(x/d + 2^(bits-1) + 0.5).
ISQ_HD void quantize_q4_0(const float* x, uint8_t* y) {
  float amax;
  const float d = div(signed_absmax(x, QK, amax), -8.f);
  const float id = d != 0.f ? div(1.f, d) : 0.f;
  put_half(y, d);
  uint8_t q[QK];
  for (int j = 0; j < QK; ++j) q[j] = static_cast<uint8_t>(clampi(static_cast<int>(add(mul(x[j], id), 8.5f)), 0, 15));
  pack_nibbles(q, y + 2);
}

ISQ_HD void quantize_q5_0(const float* x, uint8_t* y) {
  float amax;
  const float d = div(signed_absmax(x, QK, amax), -16.f);
  const float id = d != 0.f ? div(1.f, d) : 0.f;
  put_half(y, d);
  uint8_t q[QK];
  for (int j = 0; j < QK; ++j) q[j] = static_cast<uint8_t>(clampi(static_cast<int>(add(mul(x[j], id), 16.5f)), 0, 31));
  pack_fifth_bits(q, y + 2);
  for (int j = 0; j < QK; ++j) q[j] &= 0x0f;
  pack_nibbles(q, y + 6);
}

// Q4_1 / Q5_1: d = (max - min) / (2^bits - 1), m = min, q = trunc((x - min)/d + 0.5).
ISQ_HD void min_max_codes(const float* x, int nmax, uint8_t* y, uint8_t* q) {
  float min = x[0], max = x[0];
  for (int j = 1; j < QK; ++j) {
    if (x[j] < min) min = x[j];
    if (x[j] > max) max = x[j];
  }
  const float d = div(sub(max, min), static_cast<float>(nmax));
  const float id = d != 0.f ? div(1.f, d) : 0.f;
  put_half(y, d);
  put_half(y + 2, min);
  for (int j = 0; j < QK; ++j) {
    q[j] = static_cast<uint8_t>(clampi(static_cast<int>(add(mul(sub(x[j], min), id), 0.5f)), 0, nmax));
  }
}

ISQ_HD void quantize_q4_1(const float* x, uint8_t* y) {
  uint8_t q[QK];
  min_max_codes(x, 15, y, q);
  pack_nibbles(q, y + 4);
}

ISQ_HD void quantize_q5_1(const float* x, uint8_t* y) {
  uint8_t q[QK];
  min_max_codes(x, 31, y, q);
  pack_fifth_bits(q, y + 4);
  for (int j = 0; j < QK; ++j) q[j] &= 0x0f;
  pack_nibbles(q, y + 8);
}

// Q8_0: d = absmax / 127, q = round-half-away(x / d).
ISQ_HD void quantize_q8_0(const float* x, uint8_t* y) {
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(x[j]));
  const float d = div(amax, 127.f);
  const float id = d != 0.f ? div(1.f, d) : 0.f;
  put_half(y, d);
  for (int j = 0; j < QK; ++j) y[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(roundf(mul(x[j], id))));
}

// ---- 256-element super-blocks ----

// 2-bit planes: byte 32*h + l holds elements 128*h + l + 32*s at bits 2s (Q2_K/Q3_K low bits).
ISQ_HD void pack_planes2(const uint8_t* L, uint8_t* qs) {
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t* p = L + 128 * h + l;
      qs[32 * h + l] = static_cast<uint8_t>(p[0] | (p[32] << 2) | (p[64] << 4) | (p[96] << 6));
    }
  }
}

ISQ_HD void quantize_q2_k(const float* x, uint8_t* y) {
  uint8_t* scales = y;
  uint8_t* qs = y + 16;
  uint8_t L[QKK], Laux[16];
  float w[16], mins[16], sc[16];
  float max_scale = 0.f, max_min = 0.f;
  for (int j = 0; j < 16; ++j) {
    for (int l = 0; l < 16; ++l) w[l] = fabsf(x[16 * j + l]);
    sc[j] = fit_scale_min(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], Laux, -0.5f, 0.1f, 15, true);
    if (sc[j] > max_scale) max_scale = sc[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  if (max_scale > 0.f) {
    const float iscale = div(15.f, max_scale);
    for (int j = 0; j < 16; ++j) scales[j] = static_cast<uint8_t>(nearest_int(mul(iscale, sc[j])));
    put_half(y + 80, div(max_scale, 15.f));
  } else {
    for (int j = 0; j < 16; ++j) scales[j] = 0;
    put_half(y + 80, 0.f);
  }
  if (max_min > 0.f) {
    const float iscale = div(15.f, max_min);
    for (int j = 0; j < 16; ++j) scales[j] |= static_cast<uint8_t>(nearest_int(mul(iscale, mins[j])) << 4);
    put_half(y + 82, div(max_min, 15.f));
  } else {
    put_half(y + 82, 0.f);
  }
  const float d = get_half(y + 80), dmin = get_half(y + 82);
  for (int j = 0; j < 16; ++j) {
    const float dl = mul(d, static_cast<float>(scales[j] & 0xf));
    if (dl == 0.f) continue;
    const float ml = mul(dmin, static_cast<float>(scales[j] >> 4));
    for (int i = 0; i < 16; ++i) {
      L[16 * j + i] = static_cast<uint8_t>(clampi(nearest_int(div(add(x[16 * j + i], ml), dl)), 0, 3));
    }
  }
  pack_planes2(L, qs);
}

ISQ_HD void quantize_q3_k(const float* x, uint8_t* y) {
  uint8_t* hmask = y;
  uint8_t* qs = y + 32;
  uint8_t* scales = y + 96;
  int8_t L[QKK];
  float sc[16];
  float max_scale = 0.f, amax = 0.f;
  for (int j = 0; j < 16; ++j) {
    sc[j] = fit_symmetric_iterative(16, 4, x + 16 * j, L + 16 * j);
    if (fabsf(sc[j]) > amax) {
      amax = fabsf(sc[j]);
      max_scale = sc[j];
    }
  }
  for (int k = 0; k < 12; ++k) scales[k] = 0;
  if (max_scale != 0.f) {
    const float iscale = div(-32.f, max_scale);
    for (int j = 0; j < 16; ++j) {
      const int l = clampi(static_cast<int8_t>(nearest_int(mul(iscale, sc[j]))), -32, 31) + 32;
      if (j < 8) {
        scales[j] = static_cast<uint8_t>(l & 0xf);
      } else {
        scales[j - 8] |= static_cast<uint8_t>((l & 0xf) << 4);
      }
      scales[8 + j % 4] |= static_cast<uint8_t>((l >> 4) << (2 * (j / 4)));
    }
    put_half(y + 108, div(1.f, iscale));
  } else {
    put_half(y + 108, 0.f);
  }
  const float d_all = get_half(y + 108);
  for (int j = 0; j < 16; ++j) {
    const int lo = j < 8 ? scales[j] & 0xf : scales[j - 8] >> 4;
    const int s = (lo | (((scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
    const float d = mul(d_all, static_cast<float>(s));
    if (d == 0.f) continue;
    for (int i = 0; i < 16; ++i) {
      L[16 * j + i] = static_cast<int8_t>(clampi(nearest_int(div(x[16 * j + i], d)), -4, 3) + 4);
    }
  }
  for (int k = 0; k < 32; ++k) hmask[k] = 0;
  uint8_t low[QKK];
  for (int j = 0; j < QKK; ++j) {  // the high bit of element j goes to bit j/32 of hmask[j%32]
    const int l = L[j];
    if (l > 3) hmask[j % 32] |= static_cast<uint8_t>(1u << (j / 32));
    low[j] = static_cast<uint8_t>(l > 3 ? l - 4 : l);
  }
  pack_planes2(low, qs);
}

// Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes.
ISQ_HD void pack_k4_scales(const uint8_t* ls, const uint8_t* lm, uint8_t* s) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      s[j] = ls[j];
      s[j + 4] = lm[j];
    } else {
      s[j + 4] = static_cast<uint8_t>((ls[j] & 0xf) | ((lm[j] & 0xf) << 4));
      s[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
      s[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
    }
  }
}

ISQ_HD void unpack_k4_scale(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Shared by Q4_K (nmax 15) and Q5_K (nmax 31): fills y's d, dmin and scales, and codes L[256] in [0, nmax].
ISQ_HD void k4_codes(const float* x, int nmax, float rmin, float rdelta, int nstep, uint8_t* y, uint8_t* L) {
  uint8_t Laux[32], ls[8], lm[8];
  float w[32], mins[8], sc[8];
  float max_scale = 0.f, max_min = 0.f;
  for (int j = 0; j < 8; ++j) {
    const float* xb = x + 32 * j;
    float sum_x2 = 0.f;
    for (int l = 0; l < 32; ++l) sum_x2 = add(sum_x2, mul(xb[l], xb[l]));
    const float av_x = sqrt_(div(sum_x2, 32.f));
    for (int l = 0; l < 32; ++l) w[l] = add(av_x, fabsf(xb[l]));
    sc[j] = fit_scale_min(32, nmax, xb, w, L + 32 * j, &mins[j], Laux, rmin, rdelta, nstep, false);
    if (sc[j] > max_scale) max_scale = sc[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0.f ? div(63.f, max_scale) : 0.f;
  const float inv_min = max_min > 0.f ? div(63.f, max_min) : 0.f;
  for (int j = 0; j < 8; ++j) {
    const uint8_t a = static_cast<uint8_t>(nearest_int(mul(inv_scale, sc[j])));
    const uint8_t b = static_cast<uint8_t>(nearest_int(mul(inv_min, mins[j])));
    ls[j] = a < 63 ? a : 63;
    lm[j] = b < 63 ? b : 63;
  }
  pack_k4_scales(ls, lm, y + 4);
  put_half(y, div(max_scale, 63.f));
  put_half(y + 2, div(max_min, 63.f));
  const float d = get_half(y), dmin = get_half(y + 2);
  for (int j = 0; j < 8; ++j) {
    int s, m;
    unpack_k4_scale(y + 4, j, s, m);
    const float dl = mul(d, static_cast<float>(s));
    if (dl == 0.f) continue;
    const float ml = mul(dmin, static_cast<float>(m));
    for (int i = 0; i < 32; ++i) {
      L[32 * j + i] = static_cast<uint8_t>(clampi(nearest_int(div(add(x[32 * j + i], ml), dl)), 0, nmax));
    }
  }
}

ISQ_HD void quantize_q4_k(const float* x, uint8_t* y) {
  uint8_t L[QKK];
  k4_codes(x, 15, -1.f, 0.1f, 20, y, L);
  uint8_t* q = y + 16;
  for (int c = 0; c < 4; ++c) {  // chunk c: elements 64c..64c+31 low nibbles, 64c+32.. high nibbles
    for (int l = 0; l < 32; ++l) q[32 * c + l] = static_cast<uint8_t>(L[64 * c + l] | (L[64 * c + l + 32] << 4));
  }
}

ISQ_HD void quantize_q5_k(const float* x, uint8_t* y) {
  uint8_t L[QKK];
  k4_codes(x, 31, -0.5f, 0.1f, 15, y, L);
  uint8_t* qh = y + 16;
  uint8_t* ql = y + 48;
  for (int l = 0; l < 32; ++l) qh[l] = 0;
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const int a = L[64 * c + l], b = L[64 * c + l + 32];
      qh[l] |= static_cast<uint8_t>(((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1)));
      ql[32 * c + l] = static_cast<uint8_t>((a & 0xf) | ((b & 0xf) << 4));
    }
  }
}

ISQ_HD void quantize_q6_k(const float* x, uint8_t* y) {
  uint8_t* ql = y;
  uint8_t* qh = y + 128;
  int8_t* scales = reinterpret_cast<int8_t*>(y + 192);
  int8_t L[QKK];
  float sc[16];
  float max_scale = 0.f, max_abs = 0.f;
  for (int j = 0; j < 16; ++j) {
    sc[j] = fit_symmetric(16, 32, x + 16 * j, L + 16 * j);
    if (fabsf(sc[j]) > max_abs) {
      max_abs = fabsf(sc[j]);
      max_scale = sc[j];
    }
  }
  if (max_abs < GROUP_MAX_EPS) {
    for (int k = 0; k < 210; ++k) y[k] = 0;
    return;
  }
  const float iscale = div(-128.f, max_scale);
  put_half(y + 208, div(1.f, iscale));
  for (int j = 0; j < 16; ++j) {
    const int s = nearest_int(mul(iscale, sc[j]));
    scales[j] = static_cast<int8_t>(s < 127 ? s : 127);
  }
  const float d_all = get_half(y + 208);
  for (int j = 0; j < 16; ++j) {
    const float d = mul(d_all, static_cast<float>(scales[j]));
    if (d == 0.f) continue;
    for (int i = 0; i < 16; ++i) {
      L[16 * j + i] = static_cast<int8_t>(clampi(nearest_int(div(x[16 * j + i], d)), -32, 31) + 32);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int8_t* p = L + 128 * h;
    for (int l = 0; l < 32; ++l) {
      ql[64 * h + l] = static_cast<uint8_t>((p[l] & 0xf) | ((p[l + 64] & 0xf) << 4));
      ql[64 * h + l + 32] = static_cast<uint8_t>((p[l + 32] & 0xf) | ((p[l + 96] & 0xf) << 4));
      qh[32 * h + l] = static_cast<uint8_t>((p[l] >> 4) | ((p[l + 32] >> 4) << 2) | ((p[l + 64] >> 4) << 4) |
                                            ((p[l + 96] >> 4) << 6));
    }
  }
}

}  // namespace candle_vllm::isq
