#include "cpu/decoder_layer.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu/attention.h"
#include "cpu/dtype_io.h"
#include "cpu/norm.h"
#include "cpu/quant_gemv.h"

// RoPE and the bias add must round each product and sum separately, as the torch ops they replace do: no
// multiply-add contraction in this file.
#if defined(__clang__)
#pragma clang fp contract(off)
#define CVLLM_NO_CONTRACT
#elif defined(__GNUC__)
#define CVLLM_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define CVLLM_NO_CONTRACT
#endif

namespace candle_vllm::cpu {

int64_t LayerLinear::out() const {
  int64_t n = 0;
  for (const LinearPart& p : parts) n += p.rows;
  return n;
}

namespace {

// Spins briefly, then yields, then sleeps: between stages a thread waits microseconds, far less than an OpenMP
// passive barrier's sleep and wake-up; a thread still waiting after that is waiting for one the OS descheduled (a
// loaded machine), and backing off to sleeps leaves the cores to whoever runs.
class SpinBarrier {
 public:
  void set_threads(int n) { threads_ = n; }
  void wait() {
    const unsigned gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < kSpins) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else if (spins < kSpins + kYields) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

 private:
  static constexpr int kSpins = 1 << 12;
  static constexpr int kYields = 64;
  int threads_ = 1;
  std::atomic<int> count_{0};
  std::atomic<unsigned> gen_{0};
};

// Buffers shared by the threads of one call, sized for the largest layer.
struct Scratch {
  std::unique_ptr<float[]> qkv, q, attn, gathered_attn, gathered_res;
  std::vector<int32_t> seq_of;
};

std::unique_ptr<float[]> buffer(int64_t n) { return std::unique_ptr<float[]>(new float[std::max<int64_t>(n, 1)]); }

// x @ W.T for every part into y's column ranges. Each thread converts the activations itself (a few microseconds
// at decode sizes, and deterministic) rather than waiting at a barrier for one thread to do it. Ends at a barrier.
void linear(const LayerLinear& l, const float* x, int64_t m, float* y, SpinBarrier& bar) {
  thread_local std::vector<MatmulActs> acts(3);
  int64_t col = 0;
  for (size_t p = 0; p < l.parts.size(); ++p) {
    prepare_matmul_acts(x, DType::F32, l.parts[p].t, m, l.in, false, acts[p]);
    quant_matmul_share(acts[p], l.parts[p].w, l.parts[p].t, l.parts[p].rows, y + col, l.out(), DType::F32);
    col += l.parts[p].rows;
  }
  bar.wait();
}

// torch's `x1 * cos - x2 * sin`, `x2 * cos + x1 * sin` on the first rotary_dim channels of one head, in place.
CVLLM_NO_CONTRACT void rope(float* h, const float* cos_sin, int64_t rotary_dim, bool is_neox) {
  const int64_t half = rotary_dim / 2;
  const float* cos = cos_sin;
  const float* sin = cos_sin + half;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t i1 = is_neox ? i : 2 * i, i2 = is_neox ? i + half : 2 * i + 1;
    const float x1 = h[i1], x2 = h[i2];
    const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
    h[i1] = a - b;
    h[i2] = c + d;
  }
}

CVLLM_NO_CONTRACT void add_bias(float* row, const float* bias, int64_t n) {
  for (int64_t i = 0; i < n; ++i) row[i] = row[i] + bias[i];
}

// TurboQuant rows as pyengine/kv_cache/turbo.py encodes them, one f32 operation at a time as torch rounds them:
// [K codes | K absmax (4 / 3 bits) | V 4-bit codes | V absmax].
struct TurboWriter {
  int64_t D, k_bits, k_code_bytes, k_bytes, row_bytes;
  const float* signs;
  explicit TurboWriter(const DecoderStep& st, int64_t head_dim)
      : D(head_dim), k_bits(st.turbo_k_bits), k_code_bytes(head_dim * st.turbo_k_bits / 8),
        k_bytes(head_dim * st.turbo_k_bits / 8 + (st.turbo_k_bits == 8 ? 0 : 4)),
        row_bytes(head_dim * st.turbo_k_bits / 8 + (st.turbo_k_bits == 8 ? 0 : 4) + head_dim / 2 + 4),
        signs(st.turbo_signs) {}

  // codes[d] = rint(clamp(x[d] / a * half + half, 0, 2 half)), a = max |x|; returns a.
  CVLLM_NO_CONTRACT static float codes(const float* x, int64_t n, float half, uint8_t* out) {
    float a = 0.f;
    for (int64_t d = 0; d < n; ++d) a = std::max(a, std::fabs(x[d]));
    const float safe = a > 0.f ? a : 1.f;
    for (int64_t d = 0; d < n; ++d) {
      const float pre = x[d] / safe * half + half;
      out[d] = static_cast<uint8_t>(std::nearbyint(std::min(std::max(pre, 0.f), 2.f * half)));
    }
    return a;
  }

  static void nibbles(const uint8_t* c, int64_t n, uint8_t* dst) {
    for (int64_t b = 0; b < n / 2; ++b) dst[b] = static_cast<uint8_t>(c[2 * b] | (c[2 * b + 1] << 4));
  }

  void key(uint8_t* row, const float* k, float* scratch) const {
    if (k_bits == 8) {
      for (int64_t d = 0; d < D; ++d) row[d] = E4M3::store(k[d]);
      return;
    }
    std::memcpy(scratch, k, D * sizeof(float));
    turbo_rotate(scratch, signs, D);
    uint8_t* c = reinterpret_cast<uint8_t*>(scratch + D);  // D codes after the rotated values
    const float a = codes(scratch, D, k_bits == 4 ? 7.5f : 3.f, c);
    if (k_bits == 4) {
      nibbles(c, D, row);
    } else {
      for (int64_t g = 0; g < D / 8; ++g) {
        uint32_t word = 0;
        for (int i = 0; i < 8; ++i) word |= static_cast<uint32_t>(c[8 * g + i]) << (3 * i);
        row[3 * g] = word & 0xff;
        row[3 * g + 1] = (word >> 8) & 0xff;
        row[3 * g + 2] = (word >> 16) & 0xff;
      }
    }
    std::memcpy(row + k_code_bytes, &a, sizeof a);
  }

  void value(uint8_t* row, const float* v, float* scratch) const {
    uint8_t* c = reinterpret_cast<uint8_t*>(scratch);
    const float a = codes(v, D, 7.5f, c);
    nibbles(c, D, row + k_bytes);
    std::memcpy(row + k_bytes + D / 2, &a, sizeof a);
  }
};

// Bias, q/k norm and RoPE of every head of every token; q into s.q, k and v into the cache: Store::key / value
// (f32 rows, e4m3 rows from the f32 row, or TurboQuant rows). No barrier.
template <typename Store>
void heads(const DecoderLayerWeights& w, const DecoderStep& st, const Store& store, Scratch& s) {
  const int64_t D = w.head_dim, hq = w.num_heads, hk = w.num_kv_heads, per_token = hq + 2 * hk;
  const int64_t nqkv = per_token * D;
  std::vector<float> scratch(2 * D);
#pragma omp for schedule(static) nowait
  for (int64_t u = 0; u < st.num_tokens * per_token; ++u) {
    const int64_t t = u / per_token, h = u % per_token;
    float* src = s.qkv.get() + t * nqkv + h * D;
    if (w.qkv.bias != nullptr) add_bias(src, w.qkv.bias + h * D, D);
    const float* cs = w.cos_sin + st.positions[t] * w.rotary_dim;
    const int64_t slot = st.slot_mapping[t];
    if (h < hq) {
      float* dst = s.q.get() + (t * hq + h) * D;
      if (w.q_norm != nullptr) rms_norm_row(dst, src, w.q_norm, D, w.eps, DType::F32);
      else std::memcpy(dst, src, D * sizeof(float));
      rope(dst, cs, w.rotary_dim, w.is_neox);
    } else if (h < hq + hk) {
      if (w.k_norm != nullptr) rms_norm_row(src, src, w.k_norm, D, w.eps, DType::F32);
      rope(src, cs, w.rotary_dim, w.is_neox);
      store.key(slot * hk + (h - hq), src, scratch.data());
    } else {
      store.value(slot * hk + (h - hq - hk), src, scratch.data());
    }
  }
}

// Rows of a dense cache [2, num_blocks, block_size, Hk, D] holding CIO (f32, or e4m3 rounded as the CUDA writes).
template <typename CIO>
struct DenseStore {
  using C = typename CIO::storage;
  C* k_cache;
  C* v_cache;
  int64_t D;
  void key(int64_t row, const float* src, float*) const { put(k_cache + row * D, src); }
  void value(int64_t row, const float* src, float*) const { put(v_cache + row * D, src); }
  void put(C* dst, const float* src) const {
    for (int64_t d = 0; d < D; ++d) dst[d] = CIO::store(src[d]);
  }
};

template <typename CIO>
DenseStore<CIO> dense_store(void* kv_cache, const DecoderStep& st, const DecoderLayerWeights& w) {
  auto* k = static_cast<typename CIO::storage*>(kv_cache);
  return {k, k + st.num_blocks * st.block_size * w.num_kv_heads * w.head_dim, w.head_dim};
}

struct TurboStore {
  uint8_t* cache;
  TurboWriter writer;
  void key(int64_t row, const float* src, float* scratch) const {
    writer.key(cache + row * writer.row_bytes, src, scratch);
  }
  void value(int64_t row, const float* src, float* scratch) const {
    writer.value(cache + row * writer.row_bytes, src, scratch);
  }
};

struct LayerCall {
  const DecoderLayerWeights& w;
  void* kv_cache;
  bool first;               // x holds the embeddings: residual = x, x = norm(x)
  int64_t rows;             // rows after the attention (num_out_rows on the last layer when given, else T)
  const int64_t* out_rows;  // non-null on the last layer with output rows
  float* gate_up;           // [rows, 2 * intermediate]
};

// The layer up to its gate_up projection (the caller's SiLU-and-mul and the next segment's down finish it).
void layer_to_gate_up(const LayerCall& c, const DecoderStep& st, float* x, float* res, Scratch& s, SpinBarrier& bar,
                      int tid) {
  const DecoderLayerWeights& w = c.w;
  const int64_t T = st.num_tokens, H = w.hidden, qd = w.num_heads * w.head_dim;
  if (c.first) {
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < T; ++r) {
      std::memcpy(res + r * H, x + r * H, H * sizeof(float));
      rms_norm_row(x + r * H, res + r * H, w.input_norm, H, w.eps, DType::F32);
    }
  } else {
    fused_add_rms_norm_share(x, res, w.input_norm, T, H, w.eps, DType::F32);
  }
  bar.wait();
  linear(w.qkv, x, T, s.qkv.get(), bar);
  if (st.turbo_k_bits != 0) heads(w, st, TurboStore{static_cast<uint8_t*>(c.kv_cache), TurboWriter(st, w.head_dim)}, s);
  else if (st.cache_e4m3) heads(w, st, dense_store<E4M3>(c.kv_cache, st, w), s);
  else heads(w, st, dense_store<F32>(c.kv_cache, st, w), s);
  bar.wait();
  const PagedAttentionArgs a{s.attn.get(), s.q.get(), c.kv_cache, st.block_tables, st.query_start_loc, st.seq_lens,
                             st.num_seqs, T, w.num_heads, w.num_kv_heads, w.head_dim, st.block_size, st.num_blocks,
                             st.max_blocks, w.scale, w.sliding_window, 0.f, DType::F32,
                             st.turbo_k_bits != 0 ? DType::U8 : st.cache_e4m3 ? DType::F8E4M3 : DType::F32,
                             st.turbo_k_bits, st.turbo_signs};
  paged_attention_share(a, s.seq_of.data());
  bar.wait();
  const float* attn = s.attn.get();
  if (c.out_rows != nullptr) {
    if (tid == 0) {
      for (int64_t i = 0; i < c.rows; ++i) {
        std::memcpy(s.gathered_attn.get() + i * qd, attn + c.out_rows[i] * qd, qd * sizeof(float));
        std::memcpy(s.gathered_res.get() + i * H, res + c.out_rows[i] * H, H * sizeof(float));
      }
      std::memcpy(res, s.gathered_res.get(), c.rows * H * sizeof(float));
    }
    attn = s.gathered_attn.get();
    bar.wait();
  }
  linear(w.o, attn, c.rows, x, bar);
  fused_add_rms_norm_share(x, res, w.post_norm, c.rows, H, w.eps, DType::F32);
  bar.wait();
  linear(w.gate_up, x, c.rows, c.gate_up, bar);
}

int64_t rows_after_attention(size_t layer, size_t num_layers, const DecoderStep& st, const int64_t* out_rows,
                             int64_t num_out_rows) {
  return layer + 1 == num_layers && out_rows != nullptr ? num_out_rows : st.num_tokens;
}

void check_linear(const LayerLinear& l, int64_t in, int64_t out, const char* name) {
  if (l.parts.empty() || l.parts.size() > 3) throw std::invalid_argument(std::string(name) + ": 1 to 3 weight parts");
  if (l.in != in || l.out() != out)
    throw std::invalid_argument(std::string(name) + ": shape [" + std::to_string(l.out()) + ", " + std::to_string(l.in) +
                                "] does not match the layer's [" + std::to_string(out) + ", " + std::to_string(in) + "]");
  for (const LinearPart& p : l.parts)
    if (in % qtype_info(p.t).block != 0)
      throw std::invalid_argument(std::string(name) + ": in_features is not a multiple of the block size");
}

}  // namespace

void check_decoder_layer(const DecoderLayerWeights& w) {
  if (w.num_heads <= 0 || w.num_kv_heads <= 0 || w.num_heads % w.num_kv_heads != 0)
    throw std::invalid_argument("decoder layer: num_heads must be a positive multiple of num_kv_heads");
  if (w.rotary_dim <= 0 || w.rotary_dim % 2 != 0 || w.rotary_dim > w.head_dim)
    throw std::invalid_argument("decoder layer: rotary_dim must be even and at most head_dim");
  if ((w.q_norm == nullptr) != (w.k_norm == nullptr))
    throw std::invalid_argument("decoder layer: q_norm and k_norm come together");
  const int64_t qd = w.num_heads * w.head_dim, kvd = w.num_kv_heads * w.head_dim;
  check_linear(w.qkv, w.hidden, qd + 2 * kvd, "qkv");
  check_linear(w.o, qd, w.hidden, "o_proj");
  check_linear(w.gate_up, w.hidden, 2 * w.intermediate, "gate_up");
  check_linear(w.down, w.intermediate, w.hidden, "down");
  if (w.o.bias != nullptr || w.gate_up.bias != nullptr || w.down.bias != nullptr)
    throw std::invalid_argument("decoder layer: only the qkv projection may have a bias");
}

void check_decoder_step(const std::vector<const DecoderLayerWeights*>& layers, const DecoderStep& step,
                        const int64_t* out_rows, int64_t num_out_rows) {
  const int64_t T = step.num_tokens;
  if (out_rows != nullptr && (num_out_rows <= 0 || num_out_rows > T))
    throw std::invalid_argument("decoder step: num_out_rows must be in 1..num_tokens");
  for (int64_t i = 0; out_rows != nullptr && i < num_out_rows; ++i)
    if (out_rows[i] < 0 || out_rows[i] >= T) throw std::invalid_argument("decoder step: output row out of range");
  if (step.turbo_k_bits != 0) {
    for (const DecoderLayerWeights* w : layers) {
      PagedAttentionArgs probe{};
      probe.head_dim = w->head_dim;
      probe.cache_dtype = DType::U8;
      probe.turbo_k_bits = step.turbo_k_bits;
      probe.turbo_signs = step.turbo_signs;
      check_turbo_rows(probe);
    }
  }
  const int64_t slots = step.num_blocks * step.block_size;
  for (int64_t t = 0; t < T; ++t) {
    if (step.slot_mapping[t] < 0 || step.slot_mapping[t] >= slots)
      throw std::invalid_argument("decoder step: slot outside the KV cache");
    for (const DecoderLayerWeights* w : layers)
      if (step.positions[t] < 0 || step.positions[t] >= w->max_positions)
        throw std::invalid_argument("decoder step: position " + std::to_string(step.positions[t]) +
                                    " is outside the rotary table");
  }
}

void decoder_segment(const std::vector<const DecoderLayerWeights*>& layers, const std::vector<void*>& kv_caches,
                     const DecoderStep& step, size_t layer, const float* act, float* gate_up, float* x,
                     float* residual, const int64_t* out_rows, int64_t num_out_rows) {
  const size_t n = layers.size();
  if (kv_caches.size() != n) throw std::invalid_argument("decoder_segment: one KV cache per layer");
  if (layer > n || (layer > 0) != (act != nullptr) || (layer < n) != (gate_up != nullptr))
    throw std::invalid_argument("decoder_segment: segment i takes act unless i = 0 and gate_up unless i = layers");
  const int64_t T = step.num_tokens;
  if (T <= 0) return;
  Scratch s;
  if (layer < n) {
    const DecoderLayerWeights& w = *layers[layer];
    const int64_t qd = w.num_heads * w.head_dim;
    s.qkv = buffer(T * w.qkv.out());
    s.q = buffer(T * qd);
    s.attn = buffer(T * qd);
    if (layer + 1 == n && out_rows != nullptr) {
      s.gathered_attn = buffer(num_out_rows * qd);
      s.gathered_res = buffer(num_out_rows * w.hidden);
    }
    s.seq_of.resize(static_cast<size_t>(T));
    PagedAttentionArgs probe{};
    probe.num_seqs = step.num_seqs;
    probe.query_start_loc = step.query_start_loc;
    token_sequences(probe, s.seq_of.data());
  }
  SpinBarrier bar;
#pragma omp parallel
  {
#pragma omp single
    bar.set_threads(omp_get_num_threads());
    const int tid = omp_get_thread_num();
    if (layer > 0) {
      const int64_t rows = rows_after_attention(layer - 1, n, step, out_rows, num_out_rows);
      linear(layers[layer - 1]->down, act, rows, x, bar);
    }
    if (layer < n) {
      const bool cut = layer + 1 == n && out_rows != nullptr;
      const LayerCall c{*layers[layer], kv_caches[layer], layer == 0,
                        rows_after_attention(layer, n, step, out_rows, num_out_rows), cut ? out_rows : nullptr,
                        gate_up};
      layer_to_gate_up(c, step, x, residual, s, bar, tid);
    }
  }
}

}  // namespace candle_vllm::cpu
