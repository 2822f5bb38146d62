// Skinny GEMM over a [K, N] weight on tensor cores, streaming W once without shared memory.
//
// A CTA owns a strip of 64 weight columns and a split of K, in slabs of 16 k rows. Lane (g, t) of a warp loads the
// 16-byte runs at columns 8g..8g+7 of slab rows 2t, 2t + 1, 2t + 8 and 2t + 9 (the 8 lanes of one t read 128
// contiguous bytes of a row). Word j of the runs at rows k and k + 1, joined by byte permutes, holds column 8g + 2j
// at (k, k + 1) and column 8g + 2j + 1 at (k, k + 1): the A fragment of mma.m16n8k16 with the columns as its rows
// (row g: column 8g + 2j, row g + 8: 8g + 2j + 1; tile j), and x is the B operand (token g, the same k pairs). So
// each lane ends with its own columns' sums, in the weight's column order. The warps of a CTA interleave over the
// split's slabs and reduce through shared memory; with splits > 1 the last CTA of a strip adds the f32 partials
// (serial split-K, as skinny_gemm.cu). The loads carry no L2 size hint: skinny_gemm's L2::256B fetch would pull in a
// neighbour strip's bytes, which another CTA reads later (session 30's probe, benches/RESULTS.md: 2-10 % slower).
#include <string>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"
#include "cuda/skinny_gemm_kn.h"
#include "cuda/split_k.cuh"

namespace candle_vllm::cuda {
namespace {

__device__ __forceinline__ uint4 load_weight(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// kU slabs of one warp: the lane's four weight runs of each, and its B fragments for NT token groups.
template <int NT, int kU>
struct Stage {
  uint4 w[kU][4];
  uint32_t x[kU][NT][2];
};

// The split-K form (8 warps, one slab per stage, up to 8 tokens) is held to 4 CTAs per SM (64 registers, no spill;
// the compiler took 68, i.e. 3): a 4096-column weight's 64 strips then run 8 splits in one wave, the probe's best.
template <typename T, int NT, int kWarps, int kU, bool kSiluMul>
__global__ void __launch_bounds__(kWarps * 32, NT == 1 && kWarps == 8 && kU == 1 ? 4 : 1)
    skinny_gemm_kn_kernel(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w,
                          float* __restrict__ partials, int* __restrict__ counters, int M, int N, int K,
                          int slabs_per_split) {
  constexpr int kAcc = NT * 16;  // a lane's sums: NT token groups x 4 column tiles x 4
  constexpr int kStep = kWarps * kU;
  constexpr bool kPipe = kU == 1;  // the next slab's weights in flight while this one is multiplied
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int strip = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int first = split * slabs_per_split, slab_end = min(K / kSkinnyKnSlab, first + slabs_per_split);
  const T* w_lane = w + strip * kSkinnyKnStrip + 8 * g;
  const T* xs[NT];
  bool x_ok[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    x_ok[n] = n * 8 + g < M;
    xs[n] = x + static_cast<size_t>(min(n * 8 + g, M - 1)) * K + 2 * t;
  }
  float acc[NT][4][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[n][j][c] = 0.f;

  using S = Stage<NT, kU>;
  auto load_w = [&](S& st, int s) {
    constexpr int kRow[4] = {0, 1, 8, 9};
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int su = s + u * kWarps;
      const int k0 = kSkinnyKnSlab * min(su, slab_end - 1) + 2 * t;
#pragma unroll
      for (int r = 0; r < 4; ++r)
        st.w[u][r] =
            su < slab_end ? load_weight(w_lane + static_cast<size_t>(k0 + kRow[r]) * N) : make_uint4(0, 0, 0, 0);
    }
  };
  // x is the output of the kernel before (a programmatic dependent launch): read after pdl_wait, through L1.
  auto load_x = [&](S& st, int s) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int su = s + u * kWarps;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const bool live = su < slab_end && x_ok[n];
        const auto* xp = reinterpret_cast<const unsigned int*>(xs[n] + kSkinnyKnSlab * min(su, slab_end - 1));
        st.x[u][n][0] = live ? __ldca(xp) : 0u;
        st.x[u][n][1] = live ? __ldca(xp + 4) : 0u;
      }
    }
  };
  auto multiply = [&](const S& st) {
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t a[4] = {__byte_perm(word(st.w[u][0], j), word(st.w[u][1], j), 0x5410),
                               __byte_perm(word(st.w[u][0], j), word(st.w[u][1], j), 0x7632),
                               __byte_perm(word(st.w[u][2], j), word(st.w[u][3], j), 0x5410),
                               __byte_perm(word(st.w[u][2], j), word(st.w[u][3], j), 0x7632)};
#pragma unroll
        for (int n = 0; n < NT; ++n) mma_16816<T>(acc[n][j], a, st.x[u][n][0], st.x[u][n][1]);
      }
  };
  // The first stage's weights do not depend on the kernel before: they stream while it ends.
  int s = first + warp;
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
      if (s != first + warp) load_w(cur, s);
      load_x(cur, s);
      multiply(cur);
    }
  }
  pdl_launch_dependents();  // the next kernel's prologue overlaps this one's reduction

  __shared__ float red[kWarps][kAcc][32];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][(n * 4 + j) * 4 + c][lane] = acc[n][j][c];
  __syncthreads();

  // Element e of the strip: sum idx = e / 32 of lane l = e % 32 -> token n * 8 + 2 (l % 4) + (c & 1) and strip
  // column 8 (l / 4) + 2 j + (c >> 1) (c0, c1: column 2j, tokens 2t, 2t + 1; c2, c3: column 2j + 1).
  constexpr int kPer = (kAcc * 32 + kWarps * 32 - 1) / (kWarps * 32);
  float sums[kPer];
  int toks[kPer], cols[kPer];
  bool valid[kPer];
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int e = threadIdx.x + r * kWarps * 32;
    const int l = e & 31, idx = min(e >> 5, kAcc - 1), c = idx & 3, j = (idx >> 2) & 3, n = idx >> 4;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) sum += red[v][idx][l];
    sums[r] = sum;
    toks[r] = n * 8 + 2 * (l & 3) + (c & 1);
    cols[r] = 8 * (l >> 2) + 2 * j + (c >> 1);
    valid[r] = e >> 5 < kAcc && toks[r] < M;
  }
  const int col0 = strip * kSkinnyKnStrip;
  if (splits > 1) {
    size_t at[kPer];
#pragma unroll
    for (int r = 0; r < kPer; ++r) at[r] = static_cast<size_t>(toks[r]) * N + col0 + cols[r];
    if (!serial_split_k(sums, at, valid, partials, static_cast<size_t>(M) * N, &counters[strip], split, splits))
      return;
  }
  // The strip's final sums, [token][column], so the stores are coalesced and the epilogue can pair columns.
  __shared__ float tile[NT * 8][kSkinnyKnStrip + 1];
#pragma unroll
  for (int r = 0; r < kPer; ++r)
    if (valid[r]) tile[toks[r]][cols[r]] = sums[r];
  __syncthreads();
  if constexpr (kSiluMul) {
    // Columns 16j..16j+7 are the gates of features 8j..8j+7 of the strip and 16j+8..16j+15 their ups (the [N, K]
    // layout's interleave_gate_up, transposed): y = silu(gate) * up, each rounded to T first, exactly as the
    // projection followed by silu_and_mul computes it.
    constexpr int kFeat = kSkinnyKnStrip / 2;
    const int half = N / 2;
    for (int e = threadIdx.x; e < M * kFeat; e += kWarps * 32) {
      const int tok = e / kFeat, f = e % kFeat, c = 16 * (f >> 3) + (f & 7);
      const float gate = round_to<T>(tile[tok][c]), up = round_to<T>(tile[tok][c + 8]);
      y[static_cast<size_t>(tok) * half + strip * kFeat + f] = from_f32<T>(silu_mul(gate, up));
    }
  } else {
    for (int e = threadIdx.x; e < M * kSkinnyKnStrip; e += kWarps * 32) {
      const int tok = e / kSkinnyKnStrip, c = e % kSkinnyKnStrip;
      y[static_cast<size_t>(tok) * N + col0 + c] = from_f32<T>(tile[tok][c]);
    }
  }
}

// Calls f(kernel) with the instance that serves M tokens, `warps`, `stage_slabs` and the epilogue, after checking
// the launch choices: the launcher and the occupancy query must agree on it.
template <typename F>
void with_kernel(const char* what, int64_t M, int warps, int stage_slabs, bool silu_mul, DType dtype, F&& f) {
  const std::string op(what);
  if (M < 1 || M > kSkinnyKnMaxM) throw std::invalid_argument(op + ": M must be in 1..16");
  if (warps != 4 && warps != 8) throw std::invalid_argument(op + ": warps must be 4 or 8");
  if (stage_slabs != 1 && stage_slabs != 2 && stage_slabs != 4)
    throw std::invalid_argument(op + ": stage_slabs must be 1, 2 or 4");
  dispatch_float<false>(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    auto by_stage = [&](auto nt, auto wp, auto silu) {
      constexpr int kNt = decltype(nt)::value, kW = decltype(wp)::value;
      constexpr bool kSilu = decltype(silu)::value;
      if (stage_slabs == 1) f(T{}, skinny_gemm_kn_kernel<T, kNt, kW, 1, kSilu>);
      else if (stage_slabs == 2) f(T{}, skinny_gemm_kn_kernel<T, kNt, kW, 2, kSilu>);
      else f(T{}, skinny_gemm_kn_kernel<T, kNt, kW, 4, kSilu>);
    };
    auto by_warps = [&](auto nt, auto silu) {
      if (warps == 4) by_stage(nt, std::integral_constant<int, 4>{}, silu);
      else by_stage(nt, std::integral_constant<int, 8>{}, silu);
    };
    auto by_tokens = [&](auto silu) {
      if (M <= 8) by_warps(std::integral_constant<int, 1>{}, silu);
      else by_warps(std::integral_constant<int, 2>{}, silu);
    };
    if (silu_mul) by_tokens(std::true_type{});
    else by_tokens(std::false_type{});
  });
}

}  // namespace

void skinny_gemm_kn(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M, int64_t N,
                    int64_t K, int splits, int warps, int stage_slabs, bool silu_mul, DType dtype,
                    std::uintptr_t stream) {
  if (K < kSkinnyKnSlab || K % kSkinnyKnSlab != 0 || K > INT32_MAX)
    throw std::invalid_argument("skinny_gemm_kn: K must be a positive multiple of 16");
  if (N < kSkinnyKnStrip || N % kSkinnyKnStrip != 0 || N > INT32_MAX)
    throw std::invalid_argument("skinny_gemm_kn: N must be a positive multiple of 64");
  if (splits < 1) throw std::invalid_argument("skinny_gemm_kn: splits must be >= 1");
  const int slabs = static_cast<int>(K / kSkinnyKnSlab);
  const int per_split = (slabs + splits - 1) / splits;
  splits = (slabs + per_split - 1) / per_split;  // no empty split
  if (splits > 1 && (partials == nullptr || counters == nullptr))
    throw std::invalid_argument("skinny_gemm_kn: split-K needs partials and counters");
  const dim3 grid(static_cast<unsigned>(N / kSkinnyKnStrip), static_cast<unsigned>(splits));
  with_kernel("skinny_gemm_kn", M, warps, stage_slabs, silu_mul, dtype, [&](auto tag, auto kernel) {
    using T = decltype(tag);
    launch_pdl("skinny_gemm_kn", kernel, grid, dim3(warps * 32), 0, as_stream(stream), static_cast<T*>(y),
               static_cast<const T*>(x), static_cast<const T*>(w), partials, counters, static_cast<int>(M),
               static_cast<int>(N), static_cast<int>(K), per_split);
  });
}

int skinny_gemm_kn_ctas_per_sm(int64_t M, int warps, int stage_slabs, bool silu_mul, DType dtype) {
  int ctas = 0;
  with_kernel("skinny_gemm_kn_ctas_per_sm", M, warps, stage_slabs, silu_mul, dtype, [&](auto, auto kernel) {
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, warps * 32, 0),
               "skinny_gemm_kn_ctas_per_sm");
  });
  return ctas;
}

}  // namespace candle_vllm::cuda
