// AVX2 dot-product kernels: weight codes are unpacked to unsigned bytes once per block and multiplied with the
// 8-bit activation codes of every activation row by _mm256_maddubs_epi16 (u8 x s8 -> pairwise i16 sums).
// Affine terms (Q4_1's min, Q4_0's -8 offset, K types' mins) use the activation sums kept in the blocks, so a
// block costs a few integer instructions plus one float FMA per activation row. Kernels work on tiles of up to 4 weight
// rows x 4 activation rows so per-row set-up and horizontal sums are amortised and the FMA chains overlap.
#include <cmath>

#include "cpu/quant_dot.h"
#include "cpu/quant_simd.h"

#if CANDLE_VLLM_AVX2

namespace candle_vllm::cpu {
namespace {

using namespace avx2;

// Eight int32 sums of u8 x s8 products over 32 bytes.
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

// Same, each pair of 16-element halves weighted by the int16 lanes of `scale` (its low 128 bits scale
// elements 0..15, its high 128 bits elements 16..31).
inline __m256i dot_u8s8_scaled(__m256i u, __m256i s, __m256i scale) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale); }

inline __m256i scale_pair(int lo, int hi) { return _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(hi)), _mm_set1_epi16(static_cast<short>(lo))); }

template <typename Act>
inline const Act* act_row(const void* act, int64_t stride, int j) {
  return reinterpret_cast<const Act*>(static_cast<const uint8_t*>(act) + j * stride);
}

// A tile: R weight rows (row_bytes apart) times MT activation rows; out[r * MT + j].
template <typename Block, int R>
inline void weight_rows(const uint8_t* w, int64_t row_bytes, const Block* rows[R]) {
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const Block*>(w + r * row_bytes);
}

// sum_i (d*q_i + o) * xd*x_i = d*xd * sum(q_i*x_i) + o * s, with s = xd * sum(x_i) stored in the block.
template <class Ops, int R, int MT>
void dot_affine32(const uint8_t* wp, int64_t row_bytes, const void* act, int64_t stride, int64_t k, float* out) {
  const typename Ops::Block* w[R];
  weight_rows<typename Ops::Block, R>(wp, row_bytes, w);
  const BlockQ8x32* x[MT];
  for (int j = 0; j < MT; ++j) x[j] = act_row<BlockQ8x32>(act, stride, j);
  __m256 acc[R][MT];
  float off[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) {
      acc[r][j] = _mm256_setzero_ps();
      off[r][j] = 0.f;
    }
  for (int64_t b = 0; b < k / QK; ++b) {
    for (int r = 0; r < R; ++r) {
      const __m256i q = Ops::codes(w[r][b]);
      const float d = h(w[r][b].d);
      const float o = Ops::offset(w[r][b], d);
      for (int j = 0; j < MT; ++j) {
        const BlockQ8x32& xb = x[j][b];
        acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(dot_u8s8(q, load256(xb.qs))), acc[r][j]);
        off[r][j] = std::fma(o, xb.s, off[r][j]);  // one rounding in every tile shape (no compiler choice)
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) out[r * MT + j] = hsum(acc[r][j]) + off[r][j];
}

// Signed codes: |q| * (x with q's sign) keeps maddubs' unsigned operand non-negative.
template <int R, int MT>
void dot_q8_0(const uint8_t* wp, int64_t row_bytes, const void* act, int64_t stride, int64_t k, float* out) {
  const BlockQ8_0* w[R];
  weight_rows<BlockQ8_0, R>(wp, row_bytes, w);
  const BlockQ8x32* x[MT];
  for (int j = 0; j < MT; ++j) x[j] = act_row<BlockQ8x32>(act, stride, j);
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / QK; ++b) {
    for (int r = 0; r < R; ++r) {
      const __m256i q = load256(w[r][b].qs);
      const __m256i aq = _mm256_sign_epi8(q, q);
      const float d = h(w[r][b].d);
      for (int j = 0; j < MT; ++j) {
        const BlockQ8x32& xb = x[j][b];
        const __m256i sx = _mm256_sign_epi8(load256(xb.qs), q);
        acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(dot_u8s8(aq, sx)), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) out[r * MT + j] = hsum(acc[r][j]);
}

// ---- K types: per super-block, sum = d*xd * sum_g(scale_g * dot_g) - dmin*xd * sum_g(min_g * bsum_g) ----
// over 16 groups g of 16 elements. Each `*_sums` body adds the integer scaled dots to isum[j], returns the
// 16 int16 group mins in `mins` and the float factors d and dmin.

template <int MT>
inline void q2k_sums(const BlockQ2_K& b, const BlockQ8xK* const* x, __m256i* isum, __m256i& mins, float& d, float& dmin) {
  d = h(b.d);
  dmin = h(b.dmin);
  const __m128i sc = load128(b.scales);
  mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(0x0F)));
  for (int half = 0; half < 2; ++half) {
    const __m256i qv = load256(b.qs + 32 * half);
    for (int s = 0; s < 4; ++s) {
      const __m256i q = _mm256_and_si256(_mm256_srl_epi16(qv, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
      const int g = 8 * half + 2 * s;
      const __m256i scale = scale_pair(b.scales[g] & 0x0F, b.scales[g + 1] & 0x0F);
      for (int j = 0; j < MT; ++j)
        isum[j] = _mm256_add_epi32(isum[j], dot_u8s8_scaled(q, load256(x[j]->qs + 128 * half + 32 * s), scale));
    }
  }
}

// weight = d * sc * (code - 4), code = low 2 bits | high bit << 2; the "- 4" is folded into the mins.
template <int MT>
inline void q3k_sums(const BlockQ3_K& b, const BlockQ8xK* const* x, __m256i* isum, __m256i& mins, float& d, float& dmin) {
  d = dmin = h(b.d);
  int8_t sc[16];
  q3k_scales(b.scales, sc);
  mins = _mm256_slli_epi16(_mm256_cvtepi8_epi16(load128(sc)), 2);
  const __m256i hv = load256(b.hmask);
  for (int half = 0; half < 2; ++half) {
    const __m256i qv = load256(b.qs + 32 * half);
    for (int s = 0; s < 4; ++s) {
      const __m256i low = _mm256_and_si256(_mm256_srl_epi16(qv, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
      const __m256i q = _mm256_or_si256(low, bit_plane(hv, 4 * half + s, 2));
      const int g = 8 * half + 2 * s;
      const __m256i scale = scale_pair(sc[g], sc[g + 1]);
      for (int j = 0; j < MT; ++j)
        isum[j] = _mm256_add_epi32(isum[j], dot_u8s8_scaled(q, load256(x[j]->qs + 128 * half + 32 * s), scale));
    }
  }
}

inline __m256i k4_mins(const uint8_t* packed, uint8_t sc[8]) {
  alignas(32) int16_t m16[16];
  for (int sub = 0; sub < 8; ++sub) {
    uint8_t m;
    k4_scale_min(packed, sub, sc[sub], m);
    m16[2 * sub] = m16[2 * sub + 1] = m;
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(m16));
}

template <int MT>
inline void q4k_sums(const BlockQ4_K& b, const BlockQ8xK* const* x, __m256i* isum, __m256i& mins, float& d, float& dmin) {
  d = h(b.d);
  dmin = h(b.dmin);
  uint8_t sc[8];
  mins = k4_mins(b.scales, sc);
  for (int i = 0; i < 4; ++i) {  // 32 bytes hold sub-blocks 2i (low nibbles) and 2i+1 (high nibbles)
    const __m256i qv = load256(b.qs + 32 * i);
    const __m256i lo = _mm256_and_si256(qv, _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), _mm256_set1_epi8(0x0F));
    const __m256i s_lo = _mm256_set1_epi16(sc[2 * i]), s_hi = _mm256_set1_epi16(sc[2 * i + 1]);
    for (int j = 0; j < MT; ++j) {
      const __m256i p = _mm256_add_epi32(dot_u8s8_scaled(lo, load256(x[j]->qs + 64 * i), s_lo),
                                         dot_u8s8_scaled(hi, load256(x[j]->qs + 64 * i + 32), s_hi));
      isum[j] = _mm256_add_epi32(isum[j], p);
    }
  }
}

template <int MT>
inline void q5k_sums(const BlockQ5_K& b, const BlockQ8xK* const* x, __m256i* isum, __m256i& mins, float& d, float& dmin) {
  d = h(b.d);
  dmin = h(b.dmin);
  uint8_t sc[8];
  mins = k4_mins(b.scales, sc);
  const __m256i hv = load256(b.qh);
  for (int i = 0; i < 4; ++i) {
    const __m256i qv = load256(b.qs + 32 * i);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(qv, _mm256_set1_epi8(0x0F)), bit_plane(hv, 2 * i, 4));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qv, 4), _mm256_set1_epi8(0x0F)),
                                       bit_plane(hv, 2 * i + 1, 4));
    const __m256i s_lo = _mm256_set1_epi16(sc[2 * i]), s_hi = _mm256_set1_epi16(sc[2 * i + 1]);
    for (int j = 0; j < MT; ++j) {
      const __m256i p = _mm256_add_epi32(dot_u8s8_scaled(lo, load256(x[j]->qs + 64 * i), s_lo),
                                         dot_u8s8_scaled(hi, load256(x[j]->qs + 64 * i + 32), s_hi));
      isum[j] = _mm256_add_epi32(isum[j], p);
    }
  }
}

// weight = d * sc * (code - 32), code = 4 bits of ql | 2 bits of qh << 4; the "- 32" is folded into the mins.
template <int MT>
inline void q6k_sums(const BlockQ6_K& b, const BlockQ8xK* const* x, __m256i* isum, __m256i& mins, float& d, float& dmin) {
  d = dmin = h(b.d);
  mins = _mm256_slli_epi16(_mm256_cvtepi8_epi16(load128(b.scales)), 5);
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
  for (int half = 0; half < 2; ++half) {
    const __m256i qla = load256(b.ql + 64 * half), qlb = load256(b.ql + 64 * half + 32);
    const __m256i qh = load256(b.qh + 32 * half);
    const __m256i q[4] = {
        _mm256_or_si256(_mm256_and_si256(qla, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)),
        _mm256_or_si256(_mm256_and_si256(qlb, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qla, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qlb, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4)),
    };
    for (int s = 0; s < 4; ++s) {
      const int g = 8 * half + 2 * s;
      const __m256i scale = scale_pair(b.scales[g], b.scales[g + 1]);
      for (int j = 0; j < MT; ++j)
        isum[j] = _mm256_add_epi32(isum[j], dot_u8s8_scaled(q[s], load256(x[j]->qs + 128 * half + 32 * s), scale));
    }
  }
}

template <typename Block, int R, int MT,
          void (*Sums)(const Block&, const BlockQ8xK* const*, __m256i*, __m256i&, float&, float&)>
void dot_k(const uint8_t* wp, int64_t row_bytes, const void* act, int64_t stride, int64_t k, float* out) {
  const Block* w[R];
  weight_rows<Block, R>(wp, row_bytes, w);
  const BlockQ8xK* x0[MT];
  for (int j = 0; j < MT; ++j) x0[j] = act_row<BlockQ8xK>(act, stride, j);
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / QKK; ++b) {
    const BlockQ8xK* x[MT];
    for (int j = 0; j < MT; ++j) x[j] = x0[j] + b;
    for (int r = 0; r < R; ++r) {
      __m256i isum[MT];
      for (int j = 0; j < MT; ++j) isum[j] = _mm256_setzero_si256();
      __m256i mins;
      float d, dmin;
      Sums(w[r][b], x, isum, mins, d, dmin);
      for (int j = 0; j < MT; ++j) {
        const __m256i msum = _mm256_madd_epi16(mins, load256(x[j]->bsums));
        acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[j]->d), _mm256_cvtepi32_ps(isum[j]), acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * x[j]->d), _mm256_cvtepi32_ps(msum), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) out[r * MT + j] = hsum(acc[r][j]);
}

// ---- float weights against f32 activations ----

struct LoadF32 {
  static __m256 load8(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  static float load1(const uint8_t* p) { float v; std::memcpy(&v, p, 4); return v; }
  static constexpr int bytes = 4;
};
struct LoadF16 {
  static __m256 load8(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }
  static float load1(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return f16_to_f32(v); }
  static constexpr int bytes = 2;
};
struct LoadBF16 {
  static __m256 load8(const uint8_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(p)), 16));
  }
  static float load1(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return bf16_to_f32(v); }
  static constexpr int bytes = 2;
};

template <class Load, int R, int MT>
void dot_float(const uint8_t* wp, int64_t row_bytes, const void* act, int64_t stride, int64_t k, float* out) {
  const float* x[MT];
  for (int j = 0; j < MT; ++j) x[j] = act_row<float>(act, stride, j);
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    for (int r = 0; r < R; ++r) {
      const __m256 wv = Load::load8(wp + r * row_bytes + i * Load::bytes);
      for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[j] + i), acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) {
      float sum = hsum(acc[r][j]);
      for (int64_t t = i; t < k; ++t) sum += Load::load1(wp + r * row_bytes + t * Load::bytes) * x[j][t];
      out[r * MT + j] = sum;
    }
}

// ---- dispatch on the tile shape ----

// Tile shapes with instantiated kernels: kDotWeightRows (4) weight rows for a single activation row (decode),
// 2 weight rows for 1..4 activation rows, and single weight rows for the remainders.
template <template <int, int> class K>
void by_tile(const uint8_t* w, int64_t row_bytes, int wrows, const void* act, int64_t stride, int64_t k,
             int arows, float* out) {
  static_assert(kDotRows == 4 && kDotWeightRows == 4);
  if (wrows == 4 && arows == 1) return K<4, 1>::run(w, row_bytes, act, stride, k, out);
  if (wrows == 2) {
    switch (arows) {
      case 1: return K<2, 1>::run(w, row_bytes, act, stride, k, out);
      case 2: return K<2, 2>::run(w, row_bytes, act, stride, k, out);
      case 3: return K<2, 3>::run(w, row_bytes, act, stride, k, out);
      default: return K<2, 4>::run(w, row_bytes, act, stride, k, out);
    }
  }
  for (int r = 0; r < wrows; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    float* o = out + r * arows;
    switch (arows) {
      case 1: K<1, 1>::run(wr, row_bytes, act, stride, k, o); break;
      case 2: K<1, 2>::run(wr, row_bytes, act, stride, k, o); break;
      case 3: K<1, 3>::run(wr, row_bytes, act, stride, k, o); break;
      default: K<1, 4>::run(wr, row_bytes, act, stride, k, o); break;
    }
  }
}

#define CANDLE_VLLM_TILE(Name, ...) \
  template <int R, int MT> struct Name { \
    static void run(const uint8_t* w, int64_t rb, const void* a, int64_t s, int64_t k, float* o) { __VA_ARGS__(w, rb, a, s, k, o); } };
CANDLE_VLLM_TILE(Q4_0T, dot_affine32<Q4_0Ops, R, MT>)
CANDLE_VLLM_TILE(Q4_1T, dot_affine32<Q4_1Ops, R, MT>)
CANDLE_VLLM_TILE(Q5_0T, dot_affine32<Q5_0Ops, R, MT>)
CANDLE_VLLM_TILE(Q5_1T, dot_affine32<Q5_1Ops, R, MT>)
CANDLE_VLLM_TILE(Q8_0T, dot_q8_0<R, MT>)
CANDLE_VLLM_TILE(Q2_KT, dot_k<BlockQ2_K, R, MT, q2k_sums<MT>>)
CANDLE_VLLM_TILE(Q3_KT, dot_k<BlockQ3_K, R, MT, q3k_sums<MT>>)
CANDLE_VLLM_TILE(Q4_KT, dot_k<BlockQ4_K, R, MT, q4k_sums<MT>>)
CANDLE_VLLM_TILE(Q5_KT, dot_k<BlockQ5_K, R, MT, q5k_sums<MT>>)
CANDLE_VLLM_TILE(Q6_KT, dot_k<BlockQ6_K, R, MT, q6k_sums<MT>>)
CANDLE_VLLM_TILE(F32T, dot_float<LoadF32, R, MT>)
CANDLE_VLLM_TILE(F16T, dot_float<LoadF16, R, MT>)
CANDLE_VLLM_TILE(BF16T, dot_float<LoadBF16, R, MT>)
#undef CANDLE_VLLM_TILE

}  // namespace

DotKernel dot_kernel_avx2(QType t) {
  switch (t) {
    case QType::F32: return {ActKind::F32, by_tile<F32T>};
    case QType::F16: return {ActKind::F32, by_tile<F16T>};
    case QType::BF16: return {ActKind::F32, by_tile<BF16T>};
    case QType::Q4_0: return {ActKind::Q8x32, by_tile<Q4_0T>};
    case QType::Q4_1: return {ActKind::Q8x32, by_tile<Q4_1T>};
    case QType::Q5_0: return {ActKind::Q8x32, by_tile<Q5_0T>};
    case QType::Q5_1: return {ActKind::Q8x32, by_tile<Q5_1T>};
    case QType::Q8_0: return {ActKind::Q8x32, by_tile<Q8_0T>};
    case QType::Q2_K: return {ActKind::Q8xK, by_tile<Q2_KT>};
    case QType::Q3_K: return {ActKind::Q8xK, by_tile<Q3_KT>};
    case QType::Q4_K: return {ActKind::Q8xK, by_tile<Q4_KT>};
    case QType::Q5_K: return {ActKind::Q8xK, by_tile<Q5_KT>};
    case QType::Q6_K: return {ActKind::Q8xK, by_tile<Q6_KT>};
  }
  return {ActKind::F32, nullptr};
}

const char* dot_kernel_isa() { return "avx2"; }

}  // namespace candle_vllm::cpu

#else  // no AVX2: every type uses the portable kernels

namespace candle_vllm::cpu {
DotKernel dot_kernel_avx2(QType) { return {ActKind::F32, nullptr}; }
const char* dot_kernel_isa() { return "portable"; }
}  // namespace candle_vllm::cpu

#endif
