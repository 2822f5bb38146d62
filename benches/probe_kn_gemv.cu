// Can a decode GEMV read its bf16 weight stored [K, N] (x @ W, cuBLAS "NN") as fast as skinny_gemm.cu reads [N, K]?
// Session 28 measured cuBLASLt 1-5 % faster at 17-64 tokens on [K, N] weights, but the batch 1-16 kernels read
// [N, K], so the layout can only change if a [K, N] kernel keeps batch 1 at HBM speed. This probe answers that
// (benches/probe_kn_gemv.py builds and drives it; benches/RESULTS.md, session 30).
//
// No shared memory for the weights: lane (g, t) of a warp loads 16-byte runs of k rows k0 + 2t, 2t + 1, 2t + 8 and
// 2t + 9 of a 16-row slab, at columns 8 kV g + 8 v of the CTA's strip (the 8 lanes of one t read 128 kV contiguous
// bytes of a row). Two rows' registers, joined by byte permutes, are the A fragment of mma.m16n8k16 with the
// columns as its rows: word j of the run at k and at k + 1 gives row g (column 2j: k, k + 1) and row g + 8 (column
// 2j + 1). x is the B operand (token g, the same k pairs). So each lane ends with its own columns' sums, in the
// weight's column order. Warps of a CTA take every kWarps-th slab of its K range, kU slabs' loads in flight; the
// warps reduce through shared memory, and with splits > 1 the last CTA of a strip adds the f32 partials.
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"

namespace {

using bf16 = __nv_bfloat16;
using candle_vllm::cuda::launch_pdl;
using candle_vllm::cuda::mma_16816;
using candle_vllm::cuda::pdl_launch_dependents;
using candle_vllm::cuda::pdl_wait;

// No L2 size hint: the 8 lanes of a row read 128 kV contiguous bytes, and skinny_gemm's L2::256B fetches pulled in
// a neighbour strip's bytes that another CTA reads later (call 4: the hint cost 2-10 % in every cell).
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int NT, int kV, int kU>
struct Stage {
  uint4 w[kU][4][kV];  // slab u: k rows 2t, 2t + 1, 2t + 8, 2t + 9, kV runs each
  uint32_t x[kU][NT][2];
};

// NT token groups of 8, kV 16-byte runs per lane and row, kU slabs per stage; kPipe: the next stage's weights are
// loaded before the current one is multiplied (two stages of registers), else load -> use -> load.
template <int NT, int kWarps, int kV, int kU, int kPipe>
__global__ void __launch_bounds__(kWarps * 32) kn_gemv(bf16* __restrict__ y, const bf16* __restrict__ x,
                                                       const bf16* __restrict__ w, float* __restrict__ partials,
                                                       int* __restrict__ counters, int M, int N, int K,
                                                       int slabs_per_split) {
  constexpr int kTiles = 4 * kV, kAcc = NT * kTiles * 4, kStep = kWarps * kU;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int strip = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int col0 = strip * 64 * kV + 8 * kV * g;
  const int slab_end = min(K / 16, (split + 1) * slabs_per_split);
  const bf16* xs[NT];
  bool x_ok[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    x_ok[n] = n * 8 + g < M;
    xs[n] = x + static_cast<size_t>(min(n * 8 + g, M - 1)) * K + 2 * t;
  }
  float acc[NT][kTiles][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[n][i][c] = 0.f;

  using S = Stage<NT, kV, kU>;
  auto load_w = [&](S& st, int s) {
    constexpr int kRowOff[4] = {0, 1, 8, 9};
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int su = s + u * kWarps;
      const int k0 = 16 * min(su, slab_end - 1) + 2 * t;
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int v = 0; v < kV; ++v)
          st.w[u][r][v] = su < slab_end ? load_stream(w + static_cast<size_t>(k0 + kRowOff[r]) * N + col0 + 8 * v)
                                        : make_uint4(0, 0, 0, 0);
    }
  };
  auto load_x = [&](S& st, int s) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int su = s + u * kWarps;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const bool live = su < slab_end && x_ok[n];
        const bf16* xp = xs[n] + 16 * min(su, slab_end - 1);
        st.x[u][n][0] = live ? *reinterpret_cast<const uint32_t*>(xp) : 0u;
        st.x[u][n][1] = live ? *reinterpret_cast<const uint32_t*>(xp + 8) : 0u;
      }
    }
  };
  auto multiply = [&](const S& st) {
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int v = 0; v < kV; ++v)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t a[4] = {__byte_perm(word(st.w[u][0][v], j), word(st.w[u][1][v], j), 0x5410),
                                 __byte_perm(word(st.w[u][0][v], j), word(st.w[u][1][v], j), 0x7632),
                                 __byte_perm(word(st.w[u][2][v], j), word(st.w[u][3][v], j), 0x5410),
                                 __byte_perm(word(st.w[u][2][v], j), word(st.w[u][3][v], j), 0x7632)};
#pragma unroll
          for (int n = 0; n < NT; ++n) mma_16816<bf16>(acc[n][4 * v + j], a, st.x[u][n][0], st.x[u][n][1]);
        }
  };
  // Launched as a programmatic dependent (as skinny_gemm is): the first stage's weights stream while the grid before
  // ends; x and y only after the wait.
  int s = split * slabs_per_split + warp;
  S cur;
  if (s < slab_end) load_w(cur, s);
  pdl_wait();
  for (; s < slab_end; s += kStep) {
    if constexpr (kPipe) {
      S next;
      if (s + kStep < slab_end) load_w(next, s + kStep);
      load_x(cur, s);
      multiply(cur);
      cur = next;
    } else {
      if (s != split * slabs_per_split + warp) load_w(cur, s);
      load_x(cur, s);
      multiply(cur);
    }
  }
  pdl_launch_dependents();

  extern __shared__ float red[];  // [kWarps][kAcc][32]
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[(warp * kAcc + (n * kTiles + i) * 4 + c) * 32 + lane] = acc[n][i][c];
  __syncthreads();
  // Element e: accumulator idx = e / 32 of lane e % 32 -> token n * 8 + 2 t' + (c & 1), column of run v, word j.
  auto where = [&](int e, int& tok, int& col) {
    const int l = e & 31, idx = e >> 5, c = idx & 3, i = (idx >> 2) % kTiles, n = idx / (4 * kTiles);
    tok = n * 8 + 2 * (l & 3) + (c & 1);
    col = strip * 64 * kV + 8 * kV * (l >> 2) + 8 * (i >> 2) + 2 * (i & 3) + (c >> 1);
  };
  constexpr int kPer = (kAcc * 32 + kWarps * 32 - 1) / (kWarps * 32);
  float sums[kPer];
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int e = threadIdx.x + r * kWarps * 32;
    float s = 0.f;
    if (e < kAcc * 32)
#pragma unroll
      for (int v = 0; v < kWarps; ++v) s += red[(v * kAcc + (e >> 5)) * 32 + (e & 31)];
    sums[r] = s;
  }
  if (splits > 1) {
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int e = threadIdx.x + r * kWarps * 32;
      int tok, col;
      where(e, tok, col);
      if (e < kAcc * 32 && tok < M) partials[(static_cast<size_t>(split) * M + tok) * N + col] = sums[r];
    }
    __threadfence();
    __syncthreads();
    __shared__ bool is_last;
    if (threadIdx.x == 0) is_last = atomicAdd(&counters[strip], 1) == splits - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int e = threadIdx.x + r * kWarps * 32;
      int tok, col;
      where(e, tok, col);
      if (e >= kAcc * 32 || tok >= M) continue;
      float s = 0.f;
      for (int p = 0; p < splits; ++p) s += __ldcg(&partials[(static_cast<size_t>(p) * M + tok) * N + col]);
      sums[r] = s;
    }
    if (threadIdx.x == 0) counters[strip] = 0;
  }
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int e = threadIdx.x + r * kWarps * 32;
    int tok, col;
    where(e, tok, col);
    if (e < kAcc * 32 && tok < M) y[static_cast<size_t>(tok) * N + col] = __float2bfloat16(sums[r]);
  }
}

template <int NT, int kWarps, int kV, int kU, int kPipe>
int launch(bf16* y, const bf16* x, const bf16* w, float* partials, int* counters, int M, int N, int K, int splits,
           cudaStream_t stream) {
  auto kernel = kn_gemv<NT, kWarps, kV, kU, kPipe>;
  const int smem = kWarps * NT * 16 * kV * 32 * 4;
  static bool sized = false;
  if (!sized) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    sized = true;
  }
  const int slabs = K / 16, per = (slabs + splits - 1) / splits;
  splits = (slabs + per - 1) / per;
  launch_pdl("probe_kn_gemv", kernel, dim3(N / (64 * kV), splits), dim3(kWarps * 32), smem, stream, y, x, w,
             partials, counters, M, N, K, per);
  return 0;
}

template <int NT, int kWarps, int kV, int kU>
int by_pipe(int pipe, bf16* y, const bf16* x, const bf16* w, float* p, int* c, int M, int N, int K, int splits,
            cudaStream_t s) {
  return pipe == 0 ? launch<NT, kWarps, kV, kU, 0>(y, x, w, p, c, M, N, K, splits, s)
                   : launch<NT, kWarps, kV, kU, 1>(y, x, w, p, c, M, N, K, splits, s);
}

template <int NT, int kWarps, int kV>
int by_unroll(int ku, int pipe, bf16* y, const bf16* x, const bf16* w, float* p, int* c, int M, int N, int K,
              int splits, cudaStream_t s) {
  if (ku == 1) return by_pipe<NT, kWarps, kV, 1>(pipe, y, x, w, p, c, M, N, K, splits, s);
  if (ku == 2) return by_pipe<NT, kWarps, kV, 2>(pipe, y, x, w, p, c, M, N, K, splits, s);
  return by_pipe<NT, kWarps, kV, 4>(pipe, y, x, w, p, c, M, N, K, splits, s);
}

template <int NT, int kWarps>
int by_runs(int kv, int ku, int pipe, bf16* y, const bf16* x, const bf16* w, float* p, int* c, int M, int N, int K,
            int splits, cudaStream_t s) {
  return kv == 1 ? by_unroll<NT, kWarps, 1>(ku, pipe, y, x, w, p, c, M, N, K, splits, s)
                 : by_unroll<NT, kWarps, 2>(ku, pipe, y, x, w, p, c, M, N, K, splits, s);
}

template <int NT>
int by_shape(int warps, int kv, int ku, int pipe, bf16* y, const bf16* x, const bf16* w, float* p, int* c, int M,
             int N, int K, int splits, cudaStream_t s) {
  return warps == 4 ? by_runs<NT, 4>(kv, ku, pipe, y, x, w, p, c, M, N, K, splits, s)
                    : by_runs<NT, 8>(kv, ku, pipe, y, x, w, p, c, M, N, K, splits, s);
}

}  // namespace

// y [M, N] = x [M, K] @ w [K, N], bf16; M <= 16, K % 16 == 0, N % (64 kv) == 0; warps 4 or 8, kv 1 or 2, ku 1, 2
// or 4, pipe 0 or 1.
// partials: f32 [splits, M, N]; counters: int32 [N / 64], zero (left zero).
extern "C" int probe_kn_gemv(void* y, const void* x, const void* w, void* partials, void* counters, int M, int N,
                             int K, int splits, int warps, int kv, int ku, int pipe, cudaStream_t stream) {
  if (M < 1 || M > 16 || K % 16 != 0 || N % (64 * kv) != 0) return -1;
  try {
  auto* yy = static_cast<bf16*>(y);
  auto* xx = static_cast<const bf16*>(x);
  auto* ww = static_cast<const bf16*>(w);
  auto* pp = static_cast<float*>(partials);
  auto* cc = static_cast<int*>(counters);
    return M <= 8 ? by_shape<1>(warps, kv, ku, pipe, yy, xx, ww, pp, cc, M, N, K, splits, stream)
                  : by_shape<2>(warps, kv, ku, pipe, yy, xx, ww, pp, cc, M, N, K, splits, stream);
  } catch (const std::exception&) {
    return -2;
  }
}
