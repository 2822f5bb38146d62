// Skinny GEMM for 17..64 rows (batched decode): y[M, N] = x[M, K] @ W[N, K]^T, still one pass over W.
//
// At these M the activations are no longer small next to a 16-row weight tile (64 tokens x K against 16 rows
// x K), so a CTA now covers 64 weight rows with 4 warps (16 rows each) that share every activation chunk:
// the chunk [M, 128] goes global -> shared by cp.async, 3 stages deep, one barrier per chunk. Each warp streams
// its weight rows into registers two chunks ahead (16 bytes of rows g and g+8 per lane and 32-wide step, as in
// skinny_gemm.cu) and multiplies them as the A operand of mma.m16n8k16 against up to 8 token groups of 8 (the
// B operand, read from shared memory with the same permuted k mapping: one lds.128 feeds two mmas). Token rows
// are swizzled in shared memory so the two tokens a quarter-warp reads land on different banks. Split-K (few
// 64-row tiles) reduces like the narrow kernel: f32 partials, the last CTA of a tile adds them.
#include "cuda/common.cuh"
#include "cuda/mma.cuh"
#include "cuda/skinny_frag.cuh"
#include "cuda/skinny_gemm.h"
#include "cuda/smem_pipe.cuh"

namespace candle_vllm::cuda {
namespace {

constexpr int kWarps = kSkinnyWideRows / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 3;
constexpr int kSegs = kSkinnyChunkK / 8;    // 16-byte segments per token row of a chunk
constexpr int kSteps = kSkinnyChunkK / 32;  // 32-wide k steps per chunk

// Token row r keeps segment s at s ^ 4 when r is odd: a quarter-warp's lds.128 reads two tokens' 64-byte runs.
__device__ __forceinline__ int swizzle(int row, int seg) { return seg ^ ((row & 1) << 2); }

struct WeightChunk {
  uint4 lo[kSteps], hi[kSteps];  // rows g and g+8 of the warp's tile
};

template <typename T, int NT>
struct Tile {
  const T* x;
  const T* w_lo;
  const T* w_hi;
  int M, K, t, g;

  __device__ __forceinline__ void load_w(WeightChunk& c, int chunk) const {
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int k = chunk * kSkinnyChunkK + s * 32 + t * 8;
      const bool in = k < K;
      c.lo[s] = in ? load_stream(w_lo + k) : make_uint4(0, 0, 0, 0);
      c.hi[s] = in ? load_stream(w_hi + k) : make_uint4(0, 0, 0, 0);
    }
  }

  // The CTA's threads copy the [NT*8, 128] activation chunk; tokens >= M and k >= K are zero-filled.
  __device__ __forceinline__ void load_x(uint4 (&xs)[NT * 8][kSegs], int chunk) const {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int e = threadIdx.x + i * kThreads;
      const int r = e / kSegs, s = e % kSegs;
      const int k = chunk * kSkinnyChunkK + s * 8;
      const bool ok = r < M && k < K;
      cp_async16(smem_addr(&xs[r][swizzle(r, s)]), ok ? x + static_cast<size_t>(r) * K + k : x, ok);
    }
  }

  __device__ __forceinline__ void mma_chunk(float (&acc)[NT][4], const WeightChunk& c,
                                            const uint4 (&xs)[NT * 8][kSegs]) const {
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const uint4 b = xs[n * 8 + g][swizzle(g, s * 4 + t)];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t a[4] = {word(c.lo[s], 2 * j), word(c.hi[s], 2 * j), word(c.lo[s], 2 * j + 1),
                                 word(c.hi[s], 2 * j + 1)};
          mma_16816<T>(acc[n], a, word(b, 2 * j), word(b, 2 * j + 1));
        }
      }
    }
  }
};

template <typename T, int NT>
__global__ void __launch_bounds__(kThreads) skinny_gemm_wide_kernel(T* __restrict__ y, const T* __restrict__ x,
                                                                    const T* __restrict__ w,
                                                                    float* __restrict__ partials,
                                                                    int* __restrict__ counters, int M, int N, int K,
                                                                    int chunks_per_split) {
  __shared__ uint4 xs[kStages][NT * 8][kSegs];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int row0 = tile * kSkinnyWideRows + warp * 16;
  // Rows past N re-read row N-1 (in bounds); their results are dropped below.
  const Tile<T, NT> tl{x, w + static_cast<size_t>(min(row0 + g, N - 1)) * K,
                       w + static_cast<size_t>(min(row0 + g + 8, N - 1)) * K, M, K, t, g};
  const int total_chunks = (K + kSkinnyChunkK - 1) / kSkinnyChunkK;
  const int c0 = split * chunks_per_split;
  const int n = min(total_chunks, c0 + chunks_per_split) - c0;  // >= 1: the launcher leaves no empty split

  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

  tl.load_x(xs[0], c0);
  cp_async_commit();
  if (n > 1) tl.load_x(xs[1], c0 + 1);
  cp_async_commit();
  WeightChunk wa, wb;
  tl.load_w(wa, c0);
  // Chunk i: its weights were requested one chunk earlier, chunk i+1's go out now; x chunk i landed (at most
  // the group of chunk i+1 is still in flight) and after the barrier every warp is done with chunk i-1, whose
  // stage then receives chunk i+2.
  auto step = [&](int i, const WeightChunk& cur, WeightChunk& nxt) {
    if (i + 1 < n) tl.load_w(nxt, c0 + i + 1);
    cp_async_wait<1>();
    __syncthreads();
    if (i + 2 < n) tl.load_x(xs[(i + 2) % kStages], c0 + i + 2);
    cp_async_commit();
    tl.mma_chunk(acc, cur, xs[i % kStages]);
  };
  for (int i = 0; i < n; i += 2) {
    step(i, wa, wb);
    if (i + 1 < n) step(i + 1, wb, wa);
  }

  // Accumulator layout: c0,c1 = (row g, tokens 2t, 2t+1), c2,c3 = (row g+8, same tokens).
  if (splits == 1) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = row0 + g + (j >= 2 ? 8 : 0), tok = i * 8 + 2 * t + (j & 1);
        if (row < N && tok < M) y[static_cast<size_t>(tok) * N + row] = from_f32<T>(acc[i][j]);
      }
    return;
  }
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = row0 + g + (j >= 2 ? 8 : 0), tok = i * 8 + 2 * t + (j & 1);
      if (row < N && tok < M) partials[(static_cast<size_t>(split) * M + tok) * N + row] = acc[i][j];
    }
  __threadfence();
  __syncthreads();
  int last = 0;
  if (threadIdx.x == 0) last = atomicAdd(&counters[tile], 1) == splits - 1;
  if (!__syncthreads_or(last)) return;
  __threadfence();
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = row0 + g + (j >= 2 ? 8 : 0), tok = i * 8 + 2 * t + (j & 1);
      if (row >= N || tok >= M) continue;
      float s = 0.f;
      for (int p = 0; p < splits; ++p) s += __ldcg(&partials[(static_cast<size_t>(p) * M + tok) * N + row]);
      y[static_cast<size_t>(tok) * N + row] = from_f32<T>(s);
    }
  if (threadIdx.x == 0) counters[tile] = 0;
}

}  // namespace

void skinny_gemm_wide(void* y, const void* x, const void* w, float* partials, int* counters, int M, int N, int K,
                      int splits, int chunks_per_split, DType dtype, std::uintptr_t stream) {
  const dim3 grid(static_cast<unsigned>((N + kSkinnyWideRows - 1) / kSkinnyWideRows), static_cast<unsigned>(splits));
  dispatch_float<false>(dtype, "skinny_gemm", [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      kernel<<<grid, kThreads, 0, as_stream(stream)>>>(static_cast<T*>(y), static_cast<const T*>(x),
                                                       static_cast<const T*>(w), partials, counters, M, N, K,
                                                       chunks_per_split);
    };
    // Token groups of 8 rounded to the CUDA-graph buckets (24, 32, 48, 64): padding tokens cost mma slots.
    if (M <= 24) launch(skinny_gemm_wide_kernel<T, 3>);
    else if (M <= 32) launch(skinny_gemm_wide_kernel<T, 4>);
    else if (M <= 48) launch(skinny_gemm_wide_kernel<T, 6>);
    else launch(skinny_gemm_wide_kernel<T, 8>);
  });
  check_launch("skinny_gemm");
}

}  // namespace candle_vllm::cuda
