// Skinny GEMM on tensor cores, built to stream W once at HBM speed.
//
// A warp owns a tile of 16 weight rows and walks K in chunks of 128: each lane loads 16 bytes of row g and of
// row g+8 (g = lane/4) per 32-wide step, so the 4 lanes of a group read 64 contiguous bytes of a row. Those
// registers feed mma.m16n8k16 as the A operand directly: the dot product does not care in which order k is
// summed, so the k slots of the A fragment are mapped onto the bytes the lane happens to hold, and x (the B
// operand, one token per group) is loaded with the same mapping. Every weight byte is loaded once for all M
// tokens. The 4 or 8 warps of a CTA interleave over the chunks of the CTA's K range and are reduced through
// shared memory; with split-K (small N, too few tiles to fill the GPU) the last CTA of a tile adds the f32
// partials of the others (serial split-K, no second launch).
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/fp8_kv.cuh"
#include "cuda/mma.cuh"
#include "cuda/skinny_gemm.h"
#include "cuda/split_k.cuh"

namespace candle_vllm::cuda {
namespace {

constexpr int kSteps = kSkinnyChunkK / 32;  // 32-wide k steps per chunk

// Weights are read exactly once: keep them out of L1 so x stays there.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int NT>
struct Chunk {
  uint4 w_lo[kSteps], w_hi[kSteps];  // rows g and g+8
  uint4 x[NT][kSteps];               // tokens g and g+8
};

template <typename T, int NT>
__device__ __forceinline__ void load_w(Chunk<NT>& c, int chunk, int t, int K, const T* w_lo, const T* w_hi) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int k = chunk * kSkinnyChunkK + s * 32 + t * 8;
    const bool in = k < K;
    c.w_lo[s] = in ? load_stream(w_lo + k) : make_uint4(0, 0, 0, 0);
    c.w_hi[s] = in ? load_stream(w_hi + k) : make_uint4(0, 0, 0, 0);
  }
}

template <typename T, int NT>
__device__ __forceinline__ void load_x(Chunk<NT>& c, int chunk, int t, int K, const T* const (&x)[NT],
                                       const bool (&x_ok)[NT]) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int k = chunk * kSkinnyChunkK + s * 32 + t * 8;
#pragma unroll
    for (int n = 0; n < NT; ++n)
      c.x[n][s] = k < K && x_ok[n] ? __ldca(reinterpret_cast<const uint4*>(x[n] + k)) : make_uint4(0, 0, 0, 0);
  }
}

template <typename T, int NT>
__device__ __forceinline__ void mma_chunk(float (&acc)[NT][4], const Chunk<NT>& c) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // A fragment: {row g, k slots 0-1}, {row g+8, 0-1}, {row g, 8-9}, {row g+8, 8-9} of this lane.
      const uint32_t a[4] = {word(c.w_lo[s], 2 * j), word(c.w_hi[s], 2 * j), word(c.w_lo[s], 2 * j + 1),
                             word(c.w_hi[s], 2 * j + 1)};
#pragma unroll
      for (int n = 0; n < NT; ++n) mma_16816<T>(acc[n], a, word(c.x[n][s], 2 * j), word(c.x[n][s], 2 * j + 1));
    }
  }
}

enum Epilogue { kStore, kSiluMul, kRopeCache };

// The RoPE + cache epilogue for one element of a tile's final sums ([token][row] in shared memory).
template <typename T, int NT>
__device__ __forceinline__ void rope_cache_store(T* y, const float (&sums)[NT * 8][17], const SkinnyRopeCache& a,
                                                 int tile, int tok, int row, int N) {
  const int feat = tile * 16 + row, d = a.head_dim;
  const int64_t slot = a.slots[tok];
  if (feat >= a.rot_rows) {  // a v feature: stored as it is
    const T v = from_f32<T>(sums[tok][row]);
    y[static_cast<size_t>(tok) * N + feat] = v;
    const int vf = feat - a.rot_rows;
    if (slot >= 0) store_cache_value(a.value_cache, (slot * a.kv_heads + vf / d) * d + vf % d, v, a.cache_e4m3);
    return;
  }
  // Rows 0-7 of the tile are channels 8j..8j+7 of a head's first half, rows 8-15 their partners half+8j..
  const int half = d / 2, head0 = feat - feat % d, r = row & 7, ch = (feat % d) / 16 * 8 + r;
  const float* cs = a.cos_sin + a.positions[tok] * d;
  const float2 rot = rope_pair(round_to<T>(sums[tok][r]), round_to<T>(sums[tok][r + 8]), round_to<T>(cs[ch]),
                               round_to<T>(cs[half + ch]));
  const int channel = row < 8 ? ch : half + ch;
  const T v = from_f32<T>(row < 8 ? rot.x : rot.y);
  y[static_cast<size_t>(tok) * N + head0 + channel] = v;
  if (feat >= a.q_rows && slot >= 0)
    store_cache_value(a.key_cache, (slot * a.kv_heads + (head0 - a.q_rows) / d) * d + channel, v, a.cache_e4m3);
}

template <typename T, int NT, int kWarps, int kEpi>
__global__ void __launch_bounds__(kWarps * 32) skinny_gemm_kernel(T* __restrict__ y, const T* __restrict__ x,
                                                                  const T* __restrict__ w, float* __restrict__ partials,
                                                                  int* __restrict__ counters, int M, int N, int K,
                                                                  int chunks_per_split, const SkinnyRopeCache rope) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  // Rows past N re-read row N-1 (in bounds); their results are dropped below.
  const T* w_lo = w + static_cast<size_t>(min(tile * 16 + g, N - 1)) * K;
  const T* w_hi = w + static_cast<size_t>(min(tile * 16 + g + 8, N - 1)) * K;
  const T* xs[NT];
  bool x_ok[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int token = n * 8 + g;
    x_ok[n] = token < M;
    xs[n] = x + static_cast<size_t>(min(token, M - 1)) * K;
  }
  const int total_chunks = (K + kSkinnyChunkK - 1) / kSkinnyChunkK;
  const int chunk_end = min(total_chunks, (split + 1) * chunks_per_split);

  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;

  // Double-buffered: the next chunk's loads are in flight while the current one is multiplied. The first
  // chunk's weights do not depend on the kernel before this one (launch_pdl): they stream while it ends. x is
  // that kernel's output, so it is read after pdl_wait with ordinary cached loads, never the read-only path.
  int chunk = split * chunks_per_split + warp;
  Chunk<NT> cur, next;
  if (chunk < chunk_end) load_w<T, NT>(cur, chunk, t, K, w_lo, w_hi);
  pdl_wait();
  if (chunk < chunk_end) load_x<T, NT>(cur, chunk, t, K, xs, x_ok);
  for (; chunk < chunk_end; chunk += kWarps) {
    if (chunk + kWarps < chunk_end) {
      load_w<T, NT>(next, chunk + kWarps, t, K, w_lo, w_hi);
      load_x<T, NT>(next, chunk + kWarps, t, K, xs, x_ok);
    }
    mma_chunk<T, NT>(acc, cur);
    cur = next;
  }
  pdl_launch_dependents();  // the next kernel's prologue overlaps this one's reduction

  __shared__ float red[kWarps][NT * 4][32];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][n * 4 + i][lane] = acc[n][i];
  __syncthreads();

  // Accumulator layout: c0,c1 = (row g, tokens 2t, 2t+1), c2,c3 = (row g+8, same tokens). Each thread sums
  // kPer of the tile's (row, token) elements over the warps; with 8 warps and one token group, half the threads
  // have none (valid false).
  constexpr int kPer = (NT * 4 * 32 + kWarps * 32 - 1) / (kWarps * 32);
  float sums[kPer];
  int rows[kPer], toks[kPer];
  bool valid[kPer];
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int e = threadIdx.x + r * kWarps * 32;
    const int l = e & 31, idx = min(e >> 5, NT * 4 - 1), n = idx >> 2, i = idx & 3;
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) s += red[v][idx][l];
    sums[r] = s;
    rows[r] = (l >> 2) + (i >= 2 ? 8 : 0);
    toks[r] = n * 8 + (l & 3) * 2 + (i & 1);
    valid[r] = e >> 5 < NT * 4 && tile * 16 + rows[r] < N && toks[r] < M;
  }
  // The tile's final sums, [token][row], so the output stage can pair rows (gate r with up r + 8).
  __shared__ float tile_sums[NT * 8][17];
  if (splits > 1) {
    size_t at[kPer];
#pragma unroll
    for (int r = 0; r < kPer; ++r) at[r] = static_cast<size_t>(toks[r]) * N + tile * 16 + rows[r];
    if (!serial_split_k(sums, at, valid, partials, static_cast<size_t>(M) * N, &counters[tile], split, splits)) return;
  }
#pragma unroll
  for (int r = 0; r < kPer; ++r)
    if (valid[r]) tile_sums[toks[r]][rows[r]] = sums[r];
  __syncthreads();
  if constexpr (kEpi == kStore) {
    for (int e = threadIdx.x; e < NT * 8 * 16; e += kWarps * 32) {
      const int tok = e >> 4, row = e & 15, feat = tile * 16 + row;
      if (tok < M && feat < N) y[static_cast<size_t>(tok) * N + feat] = from_f32<T>(tile_sums[tok][row]);
    }
  } else if constexpr (kEpi == kRopeCache) {
    for (int e = threadIdx.x; e < NT * 8 * 16; e += kWarps * 32) {
      const int tok = e >> 4, row = e & 15;
      if (tok < M && tile * 16 + row < N) rope_cache_store<T, NT>(y, tile_sums, rope, tile, tok, row, N);
    }
  } else {
    // Rows 0-7 of the tile are gate features tile*8 .. +7 and rows 8-15 the up features of the same indices
    // (the weight's rows interleaved in groups of 8): y[tok, f] = silu(gate) * up, each rounded to T first,
    // exactly as the projection followed by silu_and_mul computes it.
    const int half = N / 2;
    for (int e = threadIdx.x; e < NT * 8 * 8; e += kWarps * 32) {
      const int tok = e >> 3, f = e & 7, feat = tile * 8 + f;
      if (tok < M && feat < half) {
        const float g = round_to<T>(tile_sums[tok][f]), u = round_to<T>(tile_sums[tok][f + 8]);
        y[static_cast<size_t>(tok) * half + feat] = from_f32<T>(silu_mul(g, u));
      }
    }
  }
}

void launch_skinny(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M, int64_t N,
                   int64_t K, int splits, int warps, Epilogue epi, const SkinnyRopeCache& rope, DType dtype,
                   std::uintptr_t stream) {
  if (M < 1 || M > kSkinnyMaxM) throw std::invalid_argument("skinny_gemm: M must be in 1..16");
  if (K % 8 != 0) throw std::invalid_argument("skinny_gemm: K must be a multiple of 8");
  if (N < 1 || splits < 1) throw std::invalid_argument("skinny_gemm: N and splits must be >= 1");
  if (warps != 4 && warps != 8) throw std::invalid_argument("skinny_gemm: warps must be 4 or 8");
  if (splits > 1 && (partials == nullptr || counters == nullptr))
    throw std::invalid_argument("skinny_gemm: split-K needs partials and counters");
  const int total_chunks = static_cast<int>((K + kSkinnyChunkK - 1) / kSkinnyChunkK);
  const int chunks_per_split = (total_chunks + splits - 1) / splits;
  splits = (total_chunks + chunks_per_split - 1) / chunks_per_split;  // no empty split
  const dim3 grid(static_cast<unsigned>((N + 15) / 16), static_cast<unsigned>(splits));
  dispatch_float<false>(dtype, "skinny_gemm", [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      launch_pdl("skinny_gemm", kernel, grid, dim3(warps * 32), 0, as_stream(stream), static_cast<T*>(y),
                 static_cast<const T*>(x), static_cast<const T*>(w), partials, counters, static_cast<int>(M),
                 static_cast<int>(N), static_cast<int>(K), chunks_per_split, rope);
    };
    auto by_warps = [&](auto nt, auto ep) {
      constexpr int kNt = decltype(nt)::value, kEp = decltype(ep)::value;
      warps == 4 ? launch(skinny_gemm_kernel<T, kNt, 4, kEp>) : launch(skinny_gemm_kernel<T, kNt, 8, kEp>);
    };
    auto by_tokens = [&](auto ep) {
      if (M <= 8) by_warps(std::integral_constant<int, 1>{}, ep);
      else by_warps(std::integral_constant<int, 2>{}, ep);
    };
    if (epi == kSiluMul) by_tokens(std::integral_constant<int, kSiluMul>{});
    else if (epi == kRopeCache) by_tokens(std::integral_constant<int, kRopeCache>{});
    else by_tokens(std::integral_constant<int, kStore>{});
  });
}

}  // namespace

void skinny_gemm(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M, int64_t N,
                 int64_t K, int splits, int warps, bool silu_mul, DType dtype, std::uintptr_t stream) {
  if (silu_mul && N % 16 != 0)
    throw std::invalid_argument("skinny_gemm: the SiLU-and-mul epilogue needs N (gate + up rows) a multiple of 16");
  launch_skinny(y, x, w, partials, counters, M, N, K, splits, warps, silu_mul ? kSiluMul : kStore, SkinnyRopeCache{},
                dtype, stream);
}

void skinny_gemm_rope_cache(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M,
                            int64_t N, int64_t K, int splits, int warps, const SkinnyRopeCache& rope, DType dtype,
                            std::uintptr_t stream) {
  const int d = rope.head_dim;
  if (d < 16 || d % 16 != 0 || rope.q_rows % d != 0 || rope.rot_rows % d != 0 || rope.q_rows >= rope.rot_rows ||
      rope.rot_rows >= N || (N - rope.rot_rows) != rope.rot_rows - rope.q_rows ||
      (rope.rot_rows - rope.q_rows) / d != rope.kv_heads)
    throw std::invalid_argument(
        "skinny_gemm_rope_cache: needs head_dim % 16 == 0 and N = q_rows + 2 * kv_heads * head_dim with whole heads");
  if (rope.positions == nullptr || rope.cos_sin == nullptr || rope.slots == nullptr || rope.key_cache == nullptr ||
      rope.value_cache == nullptr)
    throw std::invalid_argument("skinny_gemm_rope_cache: positions, cos_sin, slots and both caches are required");
  launch_skinny(y, x, w, partials, counters, M, N, K, splits, warps, kRopeCache, rope, dtype, stream);
}

}  // namespace candle_vllm::cuda
