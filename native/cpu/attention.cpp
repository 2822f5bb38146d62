#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cpu/dtype_io.h"

namespace candle_vllm::cpu {
namespace {

constexpr int64_t kTile = 32;

// IO: q and out's element; CIO: the cache's.
template <typename IO, typename CIO>
void attend_one(const PagedAttentionArgs& a, int64_t seq, int64_t token, int64_t head, float* qf, float* acc,
                float* scores) {
  using T = typename IO::storage;
  using C = typename CIO::storage;
  const int64_t D = a.head_dim, bs = a.block_size, Hk = a.num_kv_heads;
  const int64_t kv_head = head / (a.num_q_heads / Hk);
  const T* qrow = static_cast<const T*>(a.q) + (token * a.num_q_heads + head) * D;
  for (int64_t d = 0; d < D; ++d) qf[d] = IO::load(qrow[d]) * a.scale;
  const int64_t q_len = a.query_start_loc[seq + 1] - a.query_start_loc[seq];
  const int64_t pos = a.seq_lens[seq] - q_len + (token - a.query_start_loc[seq]);
  const int64_t first = a.sliding_window > 0 ? std::max<int64_t>(0, pos - a.sliding_window + 1) : 0;
  const C* k_cache = static_cast<const C*>(a.kv_cache);
  const C* v_cache = k_cache + a.num_blocks * bs * Hk * D;
  const int32_t* table = a.block_tables + seq * a.max_blocks;
  float m = -std::numeric_limits<float>::infinity(), l = 0.f;
  std::fill(acc, acc + D, 0.f);
  // Keys in tiles of kTile absolute positions (independent of the cache's block size, so results do not
  // change with --block-size): scores of a tile, then one rescale of the running sum (online softmax).
  for (int64_t start = first - first % kTile; start <= pos; start += kTile) {
    const int64_t lo = std::max(start, first), hi = std::min(start + kTile - 1, pos);
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int64_t j = lo; j <= hi; ++j) {
      const C* krow = k_cache + ((table[j / bs] * bs + j % bs) * Hk + kv_head) * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qf[d] * CIO::load(krow[d]);
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
      const C* vrow = v_cache + ((table[j / bs] * bs + j % bs) * Hk + kv_head) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += w * CIO::load(vrow[d]);
    }
    m = new_m;
  }
  T* orow = static_cast<T*>(a.out) + (token * a.num_q_heads + head) * D;
  const float inv = 1.f / l;
  for (int64_t d = 0; d < D; ++d) orow[d] = IO::store(acc[d] * inv);
}

template <typename IO, typename CIO>
void share(const PagedAttentionArgs& a, const int32_t* seq_of) {
  const int64_t work = a.num_tokens * a.num_q_heads;
  std::vector<float> qf(a.head_dim), acc(a.head_dim), scores(kTile);
#pragma omp for schedule(dynamic, 4) nowait
  for (int64_t w = 0; w < work; ++w) {
    const int64_t token = w / a.num_q_heads, head = w % a.num_q_heads;
    attend_one<IO, CIO>(a, seq_of[token], token, head, qf.data(), acc.data(), scores.data());
  }
}

template <typename IO>
void share_by_cache(const PagedAttentionArgs& a, const int32_t* seq_of) {
  if (a.cache_dtype == DType::F8E4M3) share<IO, E4M3>(a, seq_of);
  else share<IO, IO>(a, seq_of);
}

}  // namespace

void check_paged_attention(const PagedAttentionArgs& a) {
  if (a.num_q_heads % a.num_kv_heads != 0) throw std::invalid_argument("paged_attention: q heads must be a multiple of kv heads");
  if (a.dtype != DType::F32 && a.dtype != DType::F16 && a.dtype != DType::BF16)
    throw std::invalid_argument("paged_attention: dtype must be f32, f16 or bf16");
  if (a.cache_dtype != a.dtype && a.cache_dtype != DType::F8E4M3)
    throw std::invalid_argument("paged_attention: the cache must hold q's dtype or e4m3");
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
