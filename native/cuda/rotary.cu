// RoPE in place on q and k. cos/sin are rounded to the activations' dtype before use, as transformers (and
// ops/rotary.py's reference) does; the rotation itself is done in f32 and rounded once.
//
// Vectorised kernel (the usual case): one thread per (token, head, 16-byte group of pairs), flat over the
// whole batch, so a 4k-token prefill fills the GPU and a decode step is a couple of CTAs. A thread owns V =
// 16 / sizeof(T) pairs: neox channels [i, i+V) and [i+half, i+half+V), gptj the 2V adjacent channels. Its
// variant with the cache also gives threads to the v heads and stores rotated k and v at their slots.
// Shapes that do not split into 16-byte vectors fall back to the scalar kernel (one CTA per token). With a deferred
// norm (deferred_norm.h) each warp first computes 1/rms for the tokens its lanes cover, scales q, k and v by it,
// and writes v back scaled too, so q, k and v in the buffer all come out normed.
#include "cuda/common.cuh"
#include "cuda/deferred_norm.cuh"
#include "cuda/fp8_kv.cuh"
#include "cuda/rotary.h"

namespace candle_vllm::cuda {
namespace {

constexpr int kThreads = 128;

template <typename T>
__device__ __forceinline__ void rotate_heads(T* base, int heads, int head_dim, int half, const float* cs,
                                             bool is_neox) {
  for (int e = threadIdx.x; e < heads * half; e += blockDim.x) {
    const int h = e / half, i = e % half;
    T* head = base + static_cast<size_t>(h) * head_dim;
    const int i1 = is_neox ? i : 2 * i, i2 = is_neox ? i + half : 2 * i + 1;
    const float2 r = rope_pair(to_f32(head[i1]), to_f32(head[i2]), round_to<T>(cs[i]), round_to<T>(cs[half + i]));
    head[i1] = from_f32<T>(r.x);
    head[i2] = from_f32<T>(r.y);
  }
}

template <typename T>
__global__ void rotary_kernel(T* __restrict__ q, T* __restrict__ k, const int64_t* __restrict__ positions,
                              const float* __restrict__ cos_sin, int q_heads, int k_heads, int head_dim,
                              int rotary_dim, int64_t q_stride, int64_t k_stride, bool is_neox) {
  pdl_launch_dependents();
  pdl_wait();
  const int64_t t = blockIdx.x;
  const float* cs = cos_sin + positions[t] * rotary_dim;
  const int half = rotary_dim / 2;
  rotate_heads(q + t * q_stride, q_heads, head_dim, half, cs, is_neox);
  rotate_heads(k + t * k_stride, k_heads, head_dim, half, cs, is_neox);
}

template <typename T>
constexpr int kVec = 16 / sizeof(T);

template <typename T>
using Vec16 = Vec<T, kVec<T>>;

// Pointers into the rows a vectorised thread reads and writes (k/v cache pointers null without the cache). KV:
// the cache element, T or Fp8 (each value stored as fp8_kv.cuh's to_e4m3).
template <typename T, typename KV = T>
struct RotaryArgs {
  T* q;
  T* k;
  T* v;
  const int64_t* positions;
  const float* cos_sin;
  KV* key_cache;
  KV* value_cache;
  const int64_t* slots;
  int64_t tokens, q_stride, k_stride, v_stride;
  int q_heads, k_heads, head_dim, rotary_dim;
  DeferredNorm norm;
};

// The deferred norm's scale for element e's token, computed by the calling warp for every token its lanes cover
// (lane 0's element is the warp's first: kThreads is a whole number of warps). All 32 lanes must call it.
template <typename T, typename KV>
__device__ __forceinline__ float token_inv_rms(const RotaryArgs<T, KV>& a, int64_t e, int64_t total, int64_t per_token) {
  const int64_t first = e - (threadIdx.x & 31);
  if (first >= total) return 1.f;
  const int64_t last = first + 31 < total ? first + 31 : total - 1, mine = (e < total ? e : total - 1) / per_token;
  float scale = 1.f;
  for (int64_t t = first / per_token; t <= last / per_token; ++t) {
    const float s = warp_inv_rms<T>(a.norm, t);
    if (t == mine) scale = s;
  }
  return scale;
}

// GROUP 0: the standard layout of STYLE; GROUP 1 or 8 (neox only): the head's halves stored interleaved in
// groups of GROUP channels (first-half channels GROUP*j.., then their partners half+GROUP*j..), read as they are
// stored and written back in the standard layout. NORM (with CACHE only): a.norm is applied first.
template <typename T, typename KV, int STYLE, int GROUP, bool CACHE, bool NORM>
__global__ void __launch_bounds__(kThreads) rotary_vec_kernel(const RotaryArgs<T, KV> a) {
  constexpr int V = kVec<T>;
  constexpr bool NEOX = STYLE != kRopeGptj, PAIRED = GROUP > 0;
  constexpr int G = PAIRED ? GROUP : 1;
  static_assert(!PAIRED || (NEOX && V == 8 && V % G == 0),
                "a paired layout holds a thread's 8 pairs in one 16-byte vector pair of f16/bf16");
  static_assert(!NORM || CACHE, "the deferred norm comes with the cache variant");
  pdl_launch_dependents();
  const int half = a.rotary_dim / 2, groups = half / V;
  const int heads = a.q_heads + a.k_heads * (CACHE ? 2 : 1);
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t total = a.tokens * heads * groups;
  const bool live = e < total;  // a lane past the end only joins the deferred norm's warp reduction
  const int gi = static_cast<int>(e % groups);
  const int h = static_cast<int>((e / groups) % heads);
  const int64_t tok = e / (static_cast<int64_t>(groups) * heads);
  // Offsets of the thread's two vectors within a head (as stored: the paired layout holds them side by side).
  const int o1 = NEOX ? gi * V : 2 * gi * V, o2 = NEOX ? half + gi * V : 2 * gi * V + V;
  const int r1 = PAIRED ? 2 * gi * V : o1, r2 = PAIRED ? 2 * gi * V + V : o2;
  const bool is_v = CACHE && h >= a.q_heads + a.k_heads, is_k = !is_v && h >= a.q_heads;
  const int hh = is_v ? h - a.q_heads - a.k_heads : is_k ? h - a.q_heads : h;
  T* head = is_v ? a.v + tok * a.v_stride : is_k ? a.k + tok * a.k_stride : a.q + tok * a.q_stride;
  head += static_cast<int64_t>(hh) * a.head_dim;
  // Positions, slots and the cos/sin table are inputs of the step, not outputs of the kernel before.
  const int64_t slot = CACHE && live ? a.slots[tok] : -1;
  float c[V], s[V];
  if (live && !is_v) {
    const float* cs = a.cos_sin + a.positions[tok] * a.rotary_dim + gi * V;
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const float4 cv = *reinterpret_cast<const float4*>(cs + i);
      const float4 sv = *reinterpret_cast<const float4*>(cs + half + i);
      c[i] = round_to<T>(cv.x), c[i + 1] = round_to<T>(cv.y), c[i + 2] = round_to<T>(cv.z), c[i + 3] = round_to<T>(cv.w);
      s[i] = round_to<T>(sv.x), s[i + 1] = round_to<T>(sv.y), s[i + 2] = round_to<T>(sv.z), s[i + 3] = round_to<T>(sv.w);
    }
  }
  // The deferred norm's scale before the wait, while the GEMM before still runs (deferred_norm.h).
  const bool norm_early = NORM && a.norm.before_wait;
  float scale = norm_early ? token_inv_rms(a, e, total, static_cast<int64_t>(heads) * groups) : 1.f;
  pdl_wait();
  Vec16<T> v1, v2;
  if (live) {
    v1 = *reinterpret_cast<const Vec16<T>*>(head + (is_v ? o1 : r1));
    v2 = *reinterpret_cast<const Vec16<T>*>(head + (is_v ? o2 : r2));
  }
  if (NORM && !norm_early) scale = token_inv_rms(a, e, total, static_cast<int64_t>(heads) * groups);
  if (!live) return;
  if (is_v) {  // a v head: copied into the cache (scaled in place first with NORM)
    if constexpr (NORM) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        v1.v[i] = from_f32<T>(to_f32(v1.v[i]) * scale);
        v2.v[i] = from_f32<T>(to_f32(v2.v[i]) * scale);
      }
      *reinterpret_cast<Vec16<T>*>(head + o1) = v1;
      *reinterpret_cast<Vec16<T>*>(head + o2) = v2;
    }
    if (slot < 0) return;
    KV* dst = a.value_cache + (slot * a.k_heads + hh) * a.head_dim;
    *reinterpret_cast<Vec<KV, V>*>(dst + o1) = to_cache<KV>(v1);
    *reinterpret_cast<Vec<KV, V>*>(dst + o2) = to_cache<KV>(v2);
    return;
  }
  // Pair p among the 2V values v1 v2: neox (p, V + p); gptj (2p, 2p + 1); paired, first-half channel p sits at
  // (p / GROUP) * 2 GROUP + p % GROUP and its partner GROUP after it.
  float x[2 * V];
#pragma unroll
  for (int i = 0; i < V; ++i) x[i] = to_f32(v1.v[i]) * scale, x[V + i] = to_f32(v2.v[i]) * scale;
  auto first = [](int p) { return PAIRED ? p / G * 2 * G + p % G : NEOX ? p : 2 * p; };
  auto second = [](int p) { return PAIRED ? p / G * 2 * G + p % G + G : NEOX ? V + p : 2 * p + 1; };
#pragma unroll
  for (int p = 0; p < V; ++p) {
    const float2 r = rope_pair(x[first(p)], x[second(p)], c[p], s[p]);
    x[first(p)] = r.x;
    x[second(p)] = r.y;
  }
  // Standard layout out: neox and paired heads write first-half channels from v1 and their partners from v2.
#pragma unroll
  for (int i = 0; i < V; ++i) {
    v1.v[i] = from_f32<T>(x[PAIRED ? first(i) : i]);
    v2.v[i] = from_f32<T>(x[PAIRED ? second(i) : V + i]);
  }
  // Paired heads are rewritten in place in the standard layout: the head's `groups` lanes (consecutive, aligned
  // within the warp; no lane of a rotating head returned early) have all read it before any of them writes.
  if constexpr (PAIRED) __syncwarp(((1u << groups) - 1) << ((threadIdx.x & 31) - gi));
  *reinterpret_cast<Vec16<T>*>(head + o1) = v1;
  *reinterpret_cast<Vec16<T>*>(head + o2) = v2;
  if (CACHE && is_k && slot >= 0) {
    KV* dst = a.key_cache + (slot * a.k_heads + hh) * a.head_dim;
    *reinterpret_cast<Vec<KV, V>*>(dst + o1) = to_cache<KV>(v1);
    *reinterpret_cast<Vec<KV, V>*>(dst + o2) = to_cache<KV>(v2);
  }
}

template <typename T, bool CACHE, bool NORM = false, typename KV = T>
void launch_vec(const RotaryArgs<T, KV>& a, int style, int pair_group, std::uintptr_t stream) {
  if constexpr (CACHE && !NORM) {
    if (a.norm.rows != nullptr) return launch_vec<T, true, true, KV>(a, style, pair_group, stream);
  }
  const int64_t heads = a.q_heads + a.k_heads * (CACHE ? 2 : 1);
  const int64_t threads = a.tokens * heads * (a.rotary_dim / 2 / kVec<T>);
  const auto blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  const char* what = CACHE ? "rotary_embedding_cache" : "rotary_embedding";
  auto launch = [&](auto kernel) { launch_pdl(what, kernel, dim3(blocks), dim3(kThreads), 0, as_stream(stream), a); };
  if (pair_group == 0) {
    if (style == kRopeGptj) launch(rotary_vec_kernel<T, KV, kRopeGptj, 0, CACHE, NORM>);
    else launch(rotary_vec_kernel<T, KV, kRopeNeox, 0, CACHE, NORM>);
  } else if constexpr (kVec<T> == 8) {
    if (pair_group == 8) launch(rotary_vec_kernel<T, KV, kRopeNeox, 8, CACHE, NORM>);
    else launch(rotary_vec_kernel<T, KV, kRopeNeox, 1, CACHE, NORM>);
  }
}

// Whether every row a vectorised thread touches starts on a 16-byte boundary.
bool vectorizable(int64_t elem, int64_t head_dim, int64_t rotary_dim, std::initializer_list<int64_t> strides,
                  std::initializer_list<const void*> ptrs) {
  const int64_t v = 16 / elem;
  bool ok = (rotary_dim / 2) % v == 0 && head_dim % v == 0;
  for (const int64_t s : strides) ok = ok && s % v == 0;
  for (const void* p : ptrs) ok = ok && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  return ok;
}

void check_style(const char* what, int style, int pair_group, int64_t head_dim, int64_t rotary_dim, DType dtype) {
  if (style != kRopeGptj && style != kRopeNeox)
    throw std::invalid_argument(std::string(what) + ": unknown RoPE style " + std::to_string(style));
  if (pair_group != 0 && pair_group != 1 && pair_group != 8)
    throw std::invalid_argument(std::string(what) + ": pair_group must be 0 (standard layout), 1 or 8, got " +
                                std::to_string(pair_group));
  const int64_t groups = head_dim / 16;  // lanes per head in the paired kernel: a power of two within a warp
  if (pair_group != 0 && (style != kRopeNeox || dtype == DType::F32 || rotary_dim != head_dim || head_dim % 16 != 0 ||
                          groups > 16 || (groups & (groups - 1))))
    throw std::invalid_argument(std::string(what) + ": the paired layout needs neox, f16/bf16, whole-head rotary "
                                "and head_dim 16/32/64/128/256");
}

}  // namespace

void rotary_embedding(void* q, void* k, const int64_t* positions, const float* cos_sin, int64_t tokens,
                      int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                      int64_t k_stride, int style, int pair_group, DType dtype, std::uintptr_t stream) {
  if (rotary_dim % 2 != 0 || rotary_dim > head_dim)
    throw std::invalid_argument("rotary_embedding: rotary_dim must be even and <= head_dim");
  check_style("rotary_embedding", style, pair_group, head_dim, rotary_dim, dtype);
  if (tokens == 0) return;
  dispatch_float<true>(dtype, "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    if (vectorizable(sizeof(T), head_dim, rotary_dim, {q_stride, k_stride}, {q, k, cos_sin})) {
      const RotaryArgs<T> a{static_cast<T*>(q), static_cast<T*>(k), nullptr, positions, cos_sin, nullptr, nullptr,
                            nullptr, tokens, q_stride, k_stride, 0, static_cast<int>(q_heads),
                            static_cast<int>(k_heads), static_cast<int>(head_dim), static_cast<int>(rotary_dim), {}};
      launch_vec<T, false>(a, style, pair_group, stream);
      return;
    }
    if (pair_group != 0)
      throw std::invalid_argument("rotary_embedding: the paired layout needs 16-byte aligned rows of whole vectors");
    const int64_t pairs = std::max(q_heads, k_heads) * rotary_dim / 2;
    const int threads = static_cast<int>(std::min<int64_t>(512, ((pairs + 31) / 32) * 32));
    launch_pdl("rotary_embedding", rotary_kernel<T>, dim3(static_cast<unsigned>(tokens)), dim3(threads), 0,
               as_stream(stream), static_cast<T*>(q), static_cast<T*>(k), positions, cos_sin, static_cast<int>(q_heads),
               static_cast<int>(k_heads), static_cast<int>(head_dim), static_cast<int>(rotary_dim), q_stride, k_stride,
               style == kRopeNeox);
  });
}

void rotary_embedding_cache(void* q, void* k, void* v, const int64_t* positions, const float* cos_sin,
                            void* key_cache, void* value_cache, const int64_t* slots, int64_t tokens, int64_t q_heads,
                            int64_t k_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                            int style, int pair_group, DType dtype, DType cache_dtype, std::uintptr_t stream,
                            const DeferredNorm& norm) {
  check_style("rotary_embedding_cache", style, pair_group, head_dim, head_dim, dtype);
  if (cache_dtype != dtype && !(cache_dtype == DType::F8E4M3 && dtype != DType::F32))
    throw std::invalid_argument("rotary_embedding_cache: the cache must hold q's dtype, or e4m3 with f16/bf16 q");
  if (tokens == 0) return;
  dispatch_float<true>(dtype, "rotary_embedding_cache", [&](auto tag) {
    using T = decltype(tag);
    if (!vectorizable(sizeof(T), head_dim, head_dim, {q_stride, k_stride, v_stride},
                      {q, k, v, cos_sin, key_cache, value_cache}))
      throw std::invalid_argument(
          "rotary_embedding_cache: pointers, token strides and head_dim/2 must be whole 16-byte vectors");
    check_deferred_norm("rotary_embedding_cache", norm, sizeof(T));
    auto go = [&](auto kv_tag) {
      using KV = decltype(kv_tag);
      const RotaryArgs<T, KV> a{static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v), positions, cos_sin,
                                static_cast<KV*>(key_cache), static_cast<KV*>(value_cache), slots, tokens, q_stride,
                                k_stride, v_stride, static_cast<int>(q_heads), static_cast<int>(k_heads),
                                static_cast<int>(head_dim), static_cast<int>(head_dim), for_launch(norm)};
      launch_vec<T, true, false, KV>(a, style, pair_group, stream);
    };
    if constexpr (std::is_same_v<T, float>) {
      go(T{});
    } else if (cache_dtype == DType::F8E4M3) {
      go(Fp8{});
    } else {
      go(T{});
    }
  });
}

}  // namespace candle_vllm::cuda
