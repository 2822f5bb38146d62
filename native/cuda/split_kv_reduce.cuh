// Combining split-KV pieces of the paged decode attention (paged_attention.cu, the only includer): the running
// state of a column, the last CTA's reduce and the reduce kernel, plus the piece rule both sides must agree on.
#pragma once
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/smem_pipe.cuh"

namespace candle_vllm::cuda {
namespace {

// The value a running max is subtracted from: 0 while nothing was seen, so exp2(-inf - base) stays 0, not NaN.
__device__ __forceinline__ float exp_base(float m) { return m == -INFINITY ? 0.f : m; }

// Tokens per piece for a sequence attending to `span` tokens: an equal share of the pieces, whole stages of
// `unit` tokens, at most `cap` (the launcher's partition size rounded up to a stage).
__device__ __forceinline__ int piece_len(int span, int parts, int cap, int unit) {
  return max(unit, min(((span + parts - 1) / parts + unit - 1) / unit * unit, cap));
}

template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = pack2<T>(a, b);
}

// The running combination of split-KV pieces for one float4 column of one query head: the largest maximum so
// far (base-2 units, as the decode kernel keeps them), the denominator and the column sum relative to it.
struct PieceState {
  float m, den;
  float4 acc;
};

// Folds state o into st, rescaling both by 2^(their max - the new max).
__device__ __forceinline__ void merge_state(PieceState& st, const PieceState& o) {
  const float m = fmaxf(st.m, o.m), base = exp_base(m);
  const float a = exp2f(st.m - base), b = exp2f(o.m - base);
  st.m = m;
  st.den = st.den * a + o.den * b;
  st.acc = make_float4(st.acc.x * a + o.acc.x * b, st.acc.y * a + o.acc.y * b, st.acc.z * a + o.acc.z * b,
                       st.acc.w * a + o.acc.w * b);
}

// The last CTA's split-KV reduce (counters): combines the first `used` pieces of `heads` query heads from head0
// and writes their normalised rows. A thread
// per (head, float4 column) and piece row r folds pieces r, r + rows, ... (its loads do not depend on the state,
// so they go out together: one round of loads instead of a max pass, a sum pass and a row pass); the rows of a
// column then merge through `states` (blockDim.x entries of shared memory). Every thread of the CTA calls it.
// The partials may come from other CTAs of the calling grid: read through L2 (ld.cg), never a stale L1 line.
template <typename T, int D>
__device__ void reduce_pieces(T* __restrict__ out, const float* __restrict__ part_out,
                              const float* __restrict__ part_ml, size_t head0, int heads, size_t ml_l, int parts,
                              int used, PieceState* states) {
  constexpr int kCols = D / 4;
  const int items = heads * kCols;
  const int rows = max(1, min(used, static_cast<int>(blockDim.x) / items));
  const int per_round = blockDim.x / rows;
  const int r = threadIdx.x / per_round, slot = threadIdx.x % per_round;
  for (int base = 0; base < items; base += per_round) {
    const int item = base + slot;
    const bool live = item < items && r < rows;
    const size_t head = head0 + item / kCols;
    const int col = item % kCols;
    PieceState st{-INFINITY, 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
    if (live) {
      const float* ms = part_ml + head * parts;
      const float* ls = part_ml + (ml_l + head) * parts;
#pragma unroll 4
      for (int p = r; p < used; p += rows)
        merge_state(st, {__ldcg(ms + p), __ldcg(ls + p),
                         __ldcg(reinterpret_cast<const float4*>(part_out + (head * parts + p) * D) + col)});
    }
    if (rows > 1) {
      states[threadIdx.x] = st;
      __syncthreads();
      if (r == 0 && live)
        for (int i = 1; i < rows; ++i) merge_state(st, states[i * per_round + slot]);
      __syncthreads();
    }
    if (r == 0 && live) {
      const float inv = st.den > 0.f ? 1.f / st.den : 0.f;
      T* o = out + head * D + col * 4;
      store2<T>(o, st.acc.x * inv, st.acc.y * inv);
      store2<T>(o + 2, st.acc.z * inv, st.acc.w * inv);
    }
  }
}

constexpr int kReduceThreads = 256;

// The split-KV reduce as a kernel of its own, a CTA per (query head, sequence): each thread owns a float4 column
// and every kRows-th piece and folds them (merge_state; one round of independent loads), then row 0 merges the
// kRows states of its column at once (the largest maximum first, then one weighted sum: no dependent chain of
// rescales, which sits on the batch-1 decode's critical path).
template <typename T, int D>
__global__ void __launch_bounds__(kReduceThreads) paged_decode_reduce_kernel(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_ml,
    const int32_t* __restrict__ seq_lens, int num_seqs, int q_heads, int parts, int piece_cap, int unit,
    int sliding_window) {
  constexpr int kCols = D / 4;
  constexpr int kRows = kReduceThreads / kCols;
  __shared__ PieceState states[kRows][kCols];
  const size_t head = static_cast<size_t>(blockIdx.y) * q_heads + blockIdx.x;
  const int ctx = seq_lens[blockIdx.y];  // an input of the decode kernel, not its output: read before the wait
  const int span = ctx - (sliding_window > 0 ? max(0, ctx - sliding_window) : 0);
  const int plen = piece_len(span, parts, piece_cap, unit);
  const int used = min(parts, (span + plen - 1) / plen);
  pdl_launch_dependents();
  pdl_wait();
  const float* ms = part_ml + head * parts;
  const float* ls = part_ml + (static_cast<size_t>(num_seqs) * q_heads + head) * parts;
  const int col = threadIdx.x % kCols, r = threadIdx.x / kCols;
  PieceState st{-INFINITY, 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
#pragma unroll 4
  for (int p = r; p < used; p += kRows)
    merge_state(st, {__ldcg(ms + p), __ldcg(ls + p),
                     __ldcg(reinterpret_cast<const float4*>(part_out + (head * parts + p) * D) + col)});
  states[r][col] = st;
  __syncthreads();
  if (r != 0) return;
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kRows; ++i) m = fmaxf(m, states[i][col].m);
  const float base = exp_base(m);
  float den = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const PieceState& o = states[i][col];
    const float w = exp2f(o.m - base);
    den += w * o.den;
    acc.x += w * o.acc.x; acc.y += w * o.acc.y; acc.z += w * o.acc.z; acc.w += w * o.acc.w;
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  T* o = out + head * D + col * 4;
  store2<T>(o, acc.x * inv, acc.y * inv);
  store2<T>(o + 2, acc.z * inv, acc.w * inv);
}

}  // namespace
}  // namespace candle_vllm::cuda
