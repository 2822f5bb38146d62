// Pieces shared by the TurboQuant row kernels (turbo_kv.cu: write, blocks to dense; turbo_decode.cu: the CUDA-core
// decode; turbo_decode_tc.cu: the tensor-core decode; turbo_rope.cu): the row layout of pyengine/kv_cache/turbo.py,
// the Walsh-Hadamard rotation of a warp-held head vector, the queries' prologue and the warps' softmax merge of a
// decode CTA, and the launchers' host helpers.
#pragma once
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/common.cuh"

namespace candle_vllm::cuda::turbo {

constexpr int kDecodeWarps = 4;

struct RowLayout {
  int k_code_bytes, k_bytes, row_bytes;
  __host__ __device__ RowLayout(int D, int k_bits)
      : k_code_bytes(D * k_bits / 8), k_bytes(D * k_bits / 8 + (k_bits == 8 ? 0 : 4)),
        row_bytes(D * k_bits / 8 + (k_bits == 8 ? 0 : 4) + D / 2 + 4) {}
};

// x (E channels a lane) <- H x, H in Sylvester order: stage h pairs channels c and c + h.
template <int E>
__device__ __forceinline__ void hadamard(float (&x)[E]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int h = 1; h < E; h *= 2)
#pragma unroll
    for (int i = 0; i < E; i += 2 * h)
#pragma unroll
      for (int j = i; j < i + h; ++j) {
        const float u = x[j], w = x[j + h];
        x[j] = __fadd_rn(u, w);
        x[j + h] = __fsub_rn(u, w);
      }
#pragma unroll
  for (int m = 1; m < 32; m *= 2)
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float p = __shfl_xor_sync(0xffffffffu, x[e], m);
      x[e] = (lane & m) ? __fsub_rn(p, x[e]) : __fadd_rn(x[e], p);
    }
}

// x <- H (signs * x) / sqrt_d: the keys' rotation.
template <int E>
__device__ __forceinline__ void rotate(float (&x)[E], const float* signs, float sqrt_d) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] *= signs[lane * E + e];
  hadamard(x);
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = __fdiv_rn(x[e], sqrt_d);
}

__device__ __forceinline__ void store_f32(uint8_t* dst, float v) { *reinterpret_cast<float*>(dst) = v; }
__device__ __forceinline__ float load_f32(const uint8_t* src) { return *reinterpret_cast<const float*>(src); }

// E consecutive values at p (out) or into p (store_run): aligned accesses of up to 16 bytes where p allows, else
// one value at a time. A warp's lanes reading E values each touch whole sectors this way, not E times as many.
template <typename T, int E>
using RunVec = Vec<T, (E * sizeof(T) <= 16 ? E : 16 / sizeof(T))>;

template <typename T, int E>
__device__ __forceinline__ void load_run(T (&out)[E], const T* p) {
  using V = RunVec<T, E>;
  constexpr int N = sizeof(V) / sizeof(T);
  if (reinterpret_cast<uintptr_t>(p) % sizeof(V) == 0) {
#pragma unroll
    for (int i = 0; i < E / N; ++i) {
      const V v = reinterpret_cast<const V*>(p)[i];
#pragma unroll
      for (int j = 0; j < N; ++j) out[i * N + j] = v.v[j];
    }
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) out[e] = p[e];
  }
}

template <typename T, int E>
__device__ __forceinline__ void store_run(T* p, const T (&in)[E]) {
  using V = RunVec<T, E>;
  constexpr int N = sizeof(V) / sizeof(T);
  if (reinterpret_cast<uintptr_t>(p) % sizeof(V) == 0) {
#pragma unroll
    for (int i = 0; i < E / N; ++i) {
      V v;
#pragma unroll
      for (int j = 0; j < N; ++j) v.v[j] = in[i * N + j];
      reinterpret_cast<V*>(p)[i] = v;
    }
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) p[e] = in[e];
  }
}

template <typename T, int E>
__device__ __forceinline__ void load_lane(float (&x)[E], const T* row) {
  T raw[E];
  load_run(raw, row + (threadIdx.x & 31) * E);
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = to_f32(raw[e]);
}

// Tokens in each of `parts` pieces of an attended span of `span` tokens: equal shares rounded up to `unit`.
__device__ __forceinline__ int piece_tokens(int span, int parts, int unit) {
  return max(unit, ((span + parts - 1) / parts + unit - 1) / unit * unit);
}

// What a decode CTA serves, from grid (pieces, kv heads x chunks of G of their q heads, sequences): its piece, kv
// head and sequence, its `heads` live q heads from row head0 of q [S * Hq, D], and the tokens [lo, hi) of its piece
// of the sequence's attended span (the span cut into gridDim.x pieces of piece_tokens).
template <int G>
struct DecodeCta {
  int part, parts, kvh, seq, heads, lo, hi;
  int64_t head0;
  __device__ __forceinline__ DecodeCta(int q_heads, int kv_heads, const int32_t* seq_lens, int piece_unit,
                                       int sliding_window) {
    const int group = q_heads / kv_heads, chunks = (group + G - 1) / G, chunk_head = blockIdx.y % chunks * G;
    part = blockIdx.x, parts = gridDim.x, kvh = blockIdx.y / chunks, seq = blockIdx.z;
    heads = min(G, group - chunk_head);
    head0 = static_cast<int64_t>(seq) * q_heads + static_cast<int64_t>(kvh) * group + chunk_head;
    const int len = seq_lens[seq];
    const int first = sliding_window > 0 ? max(0, len - sliding_window) : 0;
    const int n = piece_tokens(len - first, parts, piece_unit);
    lo = first + part * n;
    hi = min(lo + n, len);
  }
  // Where the CTA's first query head starts in q, whose sequences are q_stride elements apart (heads packed).
  __device__ __forceinline__ int64_t q_at(int64_t q_stride, int q_heads, int head_dim) const {
    return static_cast<int64_t>(seq) * q_stride + (head0 - static_cast<int64_t>(seq) * q_heads) * head_dim;
  }
  // A piece past the attended span, where another piece writes the output: it has nothing to do, and the reduce
  // reads only the live pieces (live_pieces).
  __device__ __forceinline__ bool idle() const { return parts > 1 && lo >= hi; }
};

// How many of a sequence's pieces (the first ones) hold attended tokens: those a reduce combines.
__device__ __forceinline__ int live_pieces(int len, int piece_unit, int parts, int sliding_window) {
  const int span = len - (sliding_window > 0 ? max(0, len - sliding_window) : 0);
  const int n = piece_tokens(span, parts, piece_unit);
  return min(parts, (span + n - 1) / n);
}

// The CTA's G query heads (from q_heads, `heads` of them live; the rest zero) scaled and, with signs, rotated as
// the keys were, into sm_q; sm_qsum their sums. ROUND16: the values rounded to f16 first (the tensor-core kernel's
// operands), so the sums match what its products see.
template <typename T, int E, int G, bool ROUND16>
__device__ __forceinline__ void load_queries(float (&sm_q)[G][32 * E], float (&sm_qsum)[G], const T* q_heads, int heads,
                                             float scale, const float* signs, float sqrt_d) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int g = warp; g < G; g += kDecodeWarps) {
    float x[E];
    if (g < heads) {
      load_lane(x, q_heads + static_cast<int64_t>(g) * 32 * E);
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] *= scale;
      if (signs != nullptr) rotate(x, signs, sqrt_d);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = 0.f;
    }
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if constexpr (ROUND16) x[e] = __half2float(__float2half_rn(x[e]));
      sm_q[g][lane * E + e] = x[e];
      sum += x[e];
    }
    sum = warp_sum(sum);
    if (lane == 0) sm_qsum[g] = sum;
  }
}

// The warps' online softmaxes (sm_m: max, natural log domain; sm_l: sum; sm_acc: unnormalised output, rows of S >=
// D floats so a kernel may pad them against bank conflicts) merged per live head, a warp per head: with one piece
// the normalised output, else the piece's (max, sum, output) for turbo_reduce_kernel. Follows a __syncthreads.
template <typename T, int E, int G, int S>
__device__ __forceinline__ void merge_warps(T* out, float* partials, const float (&sm_m)[kDecodeWarps][G],
                                            const float (&sm_l)[kDecodeWarps][G],
                                            const float (&sm_acc)[kDecodeWarps][G][S], const DecodeCta<G>& cta) {
  constexpr int D = 32 * E;
  const int heads = cta.heads, part = cta.part, parts = cta.parts;
  const int64_t head0 = cta.head0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int g = warp; g < heads; g += kDecodeWarps) {
    float big = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) big = fmaxf(big, sm_m[w][g]);
    float sum = 0.f, o[E];
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = 0.f;
    if (big != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float f = __expf(sm_m[w][g] - big);
        sum += sm_l[w][g] * f;
#pragma unroll
        for (int e = 0; e < E; ++e) o[e] += sm_acc[w][g][lane * E + e] * f;
      }
    }
    const int64_t qh = head0 + g;
    if (parts == 1) {
#pragma unroll
      for (int e = 0; e < E; ++e) out[qh * D + lane * E + e] = from_f32<T>(sum > 0.f ? o[e] / sum : 0.f);
      continue;
    }
    float* p = partials + (qh * parts + part) * (D + 2);
    if (lane == 0) p[0] = big, p[1] = sum;
#pragma unroll
    for (int e = 0; e < E; ++e) p[2 + lane * E + e] = o[e];
  }
}

// Host side: the lanes' channel count E = D / 32 of a head size as a compile-time constant for f, the k_bits check,
// and sqrt(D) for the rotation's scale.
template <class F>
void dispatch_lanes(int64_t head_dim, const char* what, F&& f) {
  switch (head_dim) {
    case 64: f(std::integral_constant<int, 2>{}); return;
    case 128: f(std::integral_constant<int, 4>{}); return;
    case 256: f(std::integral_constant<int, 8>{}); return;
    default: throw std::invalid_argument(std::string(what) + ": head_dim must be 64, 128 or 256");
  }
}

inline void check_bits(int k_bits, const char* what) {
  if (k_bits != 8 && k_bits != 4 && k_bits != 3) throw std::invalid_argument(std::string(what) + ": k_bits 8, 4 or 3");
}

inline float sqrt_of(int64_t d) { return static_cast<float>(std::sqrt(static_cast<double>(d))); }

}  // namespace candle_vllm::cuda::turbo
