#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cpu/dtype_io.h"

namespace candle_vllm::cpu {
namespace {

constexpr int64_t kTile = 32;

// A cache of elements CIO ([2, blocks, block_size, Hk, D]): q . k and w * v straight from the stored values.
template <typename CIO>
struct DenseRows {
  using C = typename CIO::storage;
  const C* k_cache;
  const C* v_cache;
  int64_t D;
  DenseRows(const PagedAttentionArgs& a, float*)
      : k_cache(static_cast<const C*>(a.kv_cache)),
        v_cache(k_cache + a.num_blocks * a.block_size * a.num_kv_heads * a.head_dim), D(a.head_dim) {}
  float score(int64_t slot, const float* qf) const {
    const C* krow = k_cache + slot * D;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += qf[d] * CIO::load(krow[d]);
    return s;
  }
  void add_value(int64_t slot, float w, float* acc) const {
    const C* vrow = v_cache + slot * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += w * CIO::load(vrow[d]);
  }
};

inline float read_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

// TurboQuant rows (pyengine/kv_cache/turbo.py) [blocks, block_size, Hk, R]: [K codes | K absmax f32 (4 / 3 bits) |
// V 4-bit codes | V absmax]. Constructing it rotates the query (4 / 3 bits) as the keys were; a code c of h
// levels below zero stands for (c - h) * absmax / h, so q . k = absmax / h * (sum q_d c_d - h * sum q_d).
struct TurboRows {
  const uint8_t* cache;
  int64_t D, k_bits, k_code_bytes, k_bytes, row_bytes;
  float q_sum = 0.f;
  TurboRows(const PagedAttentionArgs& a, float* qf)
      : cache(static_cast<const uint8_t*>(a.kv_cache)), D(a.head_dim), k_bits(a.turbo_k_bits),
        k_code_bytes(a.head_dim * a.turbo_k_bits / 8), k_bytes(k_code_bytes + (a.turbo_k_bits == 8 ? 0 : 4)),
        row_bytes(k_bytes + a.head_dim / 2 + 4) {
    if (k_bits != 8) turbo_rotate(qf, a.turbo_signs, D);
    for (int64_t d = 0; d < D; ++d) q_sum += qf[d];
  }
  float score(int64_t slot, const float* qf) const {
    const uint8_t* row = cache + slot * row_bytes;
    float s = 0.f;
    if (k_bits == 8) {
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qf[d] * E4M3::load(row[d]);
      return s;
    }
    if (k_bits == 4) {
      for (int64_t b = 0; b < D / 2; ++b) s += qf[2 * b] * (row[b] & 15) + qf[2 * b + 1] * (row[b] >> 4);
      return read_f32(row + k_code_bytes) / 7.5f * (s - 7.5f * q_sum);
    }
    for (int64_t g = 0; g < D / 8; ++g) {
      const uint8_t* p = row + 3 * g;
      const uint32_t word = p[0] | (p[1] << 8) | (p[2] << 16);
      for (int i = 0; i < 8; ++i) s += qf[8 * g + i] * static_cast<float>((word >> (3 * i)) & 7);
    }
    return read_f32(row + k_code_bytes) / 3.f * (s - 3.f * q_sum);
  }
  void add_value(int64_t slot, float w, float* acc) const {
    const uint8_t* v = cache + slot * row_bytes + k_bytes;
    const float step = w * read_f32(v + D / 2) / 7.5f;
    for (int64_t b = 0; b < D / 2; ++b) {
      acc[2 * b] += step * (static_cast<float>(v[b] & 15) - 7.5f);
      acc[2 * b + 1] += step * (static_cast<float>(v[b] >> 4) - 7.5f);
    }
  }
};

// IO: q and out's element; Rows: how the cache is read (DenseRows<CIO> or TurboRows).
template <typename IO, typename Rows>
void attend_one(const PagedAttentionArgs& a, int64_t seq, int64_t token, int64_t head, float* qf, float* acc,
                float* scores) {
  using T = typename IO::storage;
  const int64_t D = a.head_dim, bs = a.block_size, Hk = a.num_kv_heads;
  const int64_t kv_head = head / (a.num_q_heads / Hk);
  const T* qrow = static_cast<const T*>(a.q) + (token * a.num_q_heads + head) * D;
  for (int64_t d = 0; d < D; ++d) qf[d] = IO::load(qrow[d]) * a.scale;
  const Rows rows(a, qf);
  const int64_t q_len = a.query_start_loc[seq + 1] - a.query_start_loc[seq];
  const int64_t pos = a.seq_lens[seq] - q_len + (token - a.query_start_loc[seq]);
  const int64_t first = a.sliding_window > 0 ? std::max<int64_t>(0, pos - a.sliding_window + 1) : 0;
  const int32_t* table = a.block_tables + seq * a.max_blocks;
  auto slot = [&](int64_t j) { return (table[j / bs] * bs + j % bs) * Hk + kv_head; };
  float m = -std::numeric_limits<float>::infinity(), l = 0.f;
  std::fill(acc, acc + D, 0.f);
  // Keys in tiles of kTile absolute positions (independent of the cache's block size, so results do not
  // change with --block-size): scores of a tile, then one rescale of the running sum (online softmax).
  for (int64_t start = first - first % kTile; start <= pos; start += kTile) {
    const int64_t lo = std::max(start, first), hi = std::min(start + kTile - 1, pos);
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int64_t j = lo; j <= hi; ++j) {
      float s = rows.score(slot(j), qf);
      if (a.softcap > 0.f) s = a.softcap * std::tanh(s / a.softcap);
      scores[j - lo] = s;
      tile_max = std::max(tile_max, s);
    }
    const float new_m = std::max(m, tile_max);
    const float correction = std::exp(m - new_m);
    l *= correction;
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
    for (int64_t j = lo; j <= hi; ++j) {
      const float w = std::exp(scores[j - lo] - new_m);
      l += w;
      rows.add_value(slot(j), w, acc);
    }
    m = new_m;
  }
  T* orow = static_cast<T*>(a.out) + (token * a.num_q_heads + head) * D;
  const float inv = 1.f / l;
  for (int64_t d = 0; d < D; ++d) orow[d] = IO::store(acc[d] * inv);
}

template <typename IO, typename Rows>
void share(const PagedAttentionArgs& a, const int32_t* seq_of) {
  const int64_t work = a.num_tokens * a.num_q_heads;
  std::vector<float> qf(a.head_dim), acc(a.head_dim), scores(kTile);
#pragma omp for schedule(dynamic, 4) nowait
  for (int64_t w = 0; w < work; ++w) {
    const int64_t token = w / a.num_q_heads, head = w % a.num_q_heads;
    attend_one<IO, Rows>(a, seq_of[token], token, head, qf.data(), acc.data(), scores.data());
  }
}

template <typename IO>
void share_by_cache(const PagedAttentionArgs& a, const int32_t* seq_of) {
  if (a.cache_dtype == DType::F8E4M3) share<IO, DenseRows<E4M3>>(a, seq_of);
  else if (a.cache_dtype == DType::U8) share<IO, TurboRows>(a, seq_of);
  else share<IO, DenseRows<IO>>(a, seq_of);
}

}  // namespace

void turbo_rotate(float* x, const float* signs, int64_t D) {
  for (int64_t d = 0; d < D; ++d) x[d] *= signs[d];
  for (int64_t h = 1; h < D; h *= 2)
    for (int64_t i = 0; i < D; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float u = x[j], w = x[j + h];
        x[j] = u + w;
        x[j + h] = u - w;
      }
  const float root = static_cast<float>(std::sqrt(static_cast<double>(D)));
  for (int64_t d = 0; d < D; ++d) x[d] = x[d] / root;
}

void check_turbo_rows(const PagedAttentionArgs& a) {
  const int64_t D = a.head_dim;
  const bool pow2 = D >= 16 && (D & (D - 1)) == 0;
  if (!((a.turbo_k_bits == 8 && D % 8 == 0 && D >= 16) ||
        ((a.turbo_k_bits == 4 || a.turbo_k_bits == 3) && pow2 && a.turbo_signs != nullptr)))
    throw std::invalid_argument("TurboQuant rows need K of 8 bits (head_dim % 8 == 0), or 4 / 3 bits with a "
                                "power-of-two head_dim and the rotation's signs");
}

void check_paged_attention(const PagedAttentionArgs& a) {
  if (a.num_q_heads % a.num_kv_heads != 0) throw std::invalid_argument("paged_attention: q heads must be a multiple of kv heads");
  if (a.dtype != DType::F32 && a.dtype != DType::F16 && a.dtype != DType::BF16)
    throw std::invalid_argument("paged_attention: dtype must be f32, f16 or bf16");
  if (a.cache_dtype == DType::U8) return check_turbo_rows(a);
  if (a.cache_dtype != a.dtype && a.cache_dtype != DType::F8E4M3)
    throw std::invalid_argument("paged_attention: the cache must hold q's dtype, e4m3 or TurboQuant rows");
}

void token_sequences(const PagedAttentionArgs& a, int32_t* seq_of) {
  for (int64_t s = 0; s < a.num_seqs; ++s)
    for (int32_t t = a.query_start_loc[s]; t < a.query_start_loc[s + 1]; ++t) seq_of[t] = static_cast<int32_t>(s);
}

void paged_attention_share(const PagedAttentionArgs& a, const int32_t* seq_of) {
  switch (a.dtype) {
    case DType::F32: return share_by_cache<F32>(a, seq_of);
    case DType::F16: return share_by_cache<F16>(a, seq_of);
    case DType::BF16: return share_by_cache<BF16>(a, seq_of);
    default: return;  // rejected by check_paged_attention before any parallel region
  }
}

void paged_attention(const PagedAttentionArgs& a) {
  check_paged_attention(a);
  std::vector<int32_t> seq_of(a.num_tokens);
  token_sequences(a, seq_of.data());
#pragma omp parallel
  paged_attention_share(a, seq_of.data());
}

}  // namespace candle_vllm::cpu
