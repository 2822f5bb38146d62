// Decode GEMM for 17..64 tokens on Hopper's warpgroup tensor cores: y[M, N] = x[M, K] @ W[N, K]^T, W read once.
//
// cuBLAS reads the 8B decode weights at 64-90 % of HBM bandwidth at 64 tokens; the skinny GEMM (M <= 16) keeps
// its weight tile in registers and feeds mma.sync, which at 64 tokens would issue 64 mma + 32 ldmatrix per 4 KB
// of weights per warp (session 2's wide kernel: 51 % of bandwidth). wgmma reads both operands from shared
// memory itself, so a CTA here is one warpgroup that only copies and issues: it owns 64 weight rows (the wgmma
// M), streams K in stages of 64 (a 128-byte row per weight row and per token, 128B-swizzled as wgmma reads
// K-major tiles) through a 4-stage cp.async pipeline, and multiplies each stage with 4 wgmma.m64n64k16 into 32
// f32 accumulators per thread; token rows past M are zero-filled. Serial split-K as in the skinny GEMM (the last
// CTA of a tile adds the others' f32 partials). The accumulator holds rows g and g+8 of each 16-row group in
// one thread, so the SwiGLU epilogue of an interleaved gate/up weight (ops.row_pairs) is register-local.
#include "cuda/common.cuh"
#include "cuda/smem_pipe.cuh"
#include "cuda/wide_gemm.h"

namespace candle_vllm::cuda {
namespace {

constexpr int kRows = 64;                           // weight rows per CTA (wgmma M)
constexpr int kKStage = 64;                         // K per stage: one 128-byte swizzle row
constexpr int kStages = 4;
constexpr int kThreads = 128;                       // one warpgroup
constexpr int kTileBytes = kRows * kKStage * 2;     // 8 KB; the token tile (64 tokens) is the same size
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the tiles to 1024 B

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CANDLE_VLLM_WGMMA 1
#endif

// Byte offset of 16-byte chunk c of row r in a K-major tile with the 128-byte swizzle.
__device__ __forceinline__ uint32_t swizzled(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// wgmma descriptor of a K-major, 128B-swizzled tile at shared address addr: 8-row groups 1024 B apart (the
// stride byte offset); the leading byte offset is unused for this layout. A k16 step advances addr by 32 B.
__device__ __forceinline__ uint64_t tile_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

#ifdef CANDLE_VLLM_WGMMA
__device__ __forceinline__ void fence_accumulators(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <typename T>
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[32], uint64_t a, uint64_t b, int accumulate);

template <>
__device__ __forceinline__ void wgmma_64x64x16<__nv_bfloat16>(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_64x64x16<__half>(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}
#endif

template <typename T, bool kSiluMul>
__global__ void __launch_bounds__(kThreads) wide_gemm_kernel(T* __restrict__ y, const T* __restrict__ x,
                                                             const T* __restrict__ w, float* __restrict__ partials,
                                                             int* __restrict__ counters, int M, int N, int K,
                                                             int stages_per_split) {
#ifdef CANDLE_VLLM_WGMMA
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tile = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int total = (K + kKStage - 1) / kKStage;
  const int first = split * stages_per_split, count = min(total, first + stages_per_split) - first;

  // Thread tid copies chunks tid + 128 i (i < 4) of each 64x128-byte tile: row q / 8, 16-byte chunk q % 8.
  auto load_w = [&](int it, int buf) {
    const int k0 = (first + it) * kKStage;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = tid + kThreads * i, r = q >> 3, c = q & 7, k = k0 + c * 8;
      const T* src = w + static_cast<size_t>(min(tile * kRows + r, N - 1)) * K + min(k, K - 8);
      cp_async16(base + buf * kStageBytes + swizzled(r, c), src, k < K);
    }
  };
  auto load_x = [&](int it, int buf) {
    const int k0 = (first + it) * kKStage;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = tid + kThreads * i, r = q >> 3, c = q & 7, k = k0 + c * 8;
      const T* src = x + static_cast<size_t>(min(r, M - 1)) * K + min(k, K - 8);
      cp_async16(base + buf * kStageBytes + kTileBytes + swizzled(r, c), src, r < M && k < K);
    }
  };

  // The weights do not depend on the kernel before (launch_pdl): their first stages stream while it ends.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < count) load_w(s, s);
  pdl_wait();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count) load_x(s, s);
    cp_async_commit();
  }

  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  for (int it = 0; it < count; ++it) {
    const int buf = it % kStages;
    cp_async_wait<kStages - 2>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async wrote it; wgmma reads it
    __syncthreads();
    fence_accumulators(acc);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < kKStage / 16; ++kk) {
      const uint32_t wa = base + buf * kStageBytes + kk * 32;
      wgmma_64x64x16<T>(acc, tile_desc(wa), tile_desc(wa + kTileBytes), it > 0 || kk > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    fence_accumulators(acc);
    // The previous stage's products are done, so its buffer takes the stage kStages - 1 ahead.
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    const int next = it + kStages - 1;
    if (next < count) {
      load_w(next, next % kStages);
      load_x(next, next % kStages);
    }
    cp_async_commit();
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_accumulators(acc);
  pdl_launch_dependents();

  // acc[4j + 0..1]: feature row g, tokens 8j + 2t + 0..1; acc[4j + 2..3]: row g + 8 (g = 16 warp + lane / 4).
  const int g = tile * kRows + 16 * warp + (lane >> 2), t2 = 2 * (lane & 3);
  if (splits > 1) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int tok = 8 * (i >> 2) + t2 + (i & 1), feat = g + ((i & 2) ? 8 : 0);
      if (tok < M && feat < N) partials[(static_cast<size_t>(split) * M + tok) * N + feat] = acc[i];
    }
    __threadfence();
    __syncthreads();
    __shared__ bool is_last;
    if (tid == 0) is_last = atomicAdd(&counters[tile], 1) == splits - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int tok = 8 * (i >> 2) + t2 + (i & 1), feat = g + ((i & 2) ? 8 : 0);
      if (tok >= M || feat >= N) continue;
      float s = 0.f;
      for (int p = 0; p < splits; ++p) s += __ldcg(&partials[(static_cast<size_t>(p) * M + tok) * N + feat]);
      acc[i] = s;
    }
    if (tid == 0) counters[tile] = 0;
  }
  if constexpr (!kSiluMul) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int tok = 8 * (i >> 2) + t2 + (i & 1), feat = g + ((i & 2) ? 8 : 0);
      if (tok < M && feat < N) y[static_cast<size_t>(tok) * N + feat] = from_f32<T>(acc[i]);
    }
  } else {
    // Rows g and g + 8 are the gate and up rows of feature (g / 16) * 8 + g % 16 (interleaved in groups of 8).
    const int half = N / 2, feat = (g >> 4) * 8 + (g & 15);
#pragma unroll
    for (int i = 0; i < 32; i += 4)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = 8 * (i >> 2) + t2 + e;
        if (tok < M && feat < half)
          y[static_cast<size_t>(tok) * half + feat] =
              from_f32<T>(silu_mul(round_to<T>(acc[i + e]), round_to<T>(acc[i + 2 + e])));
      }
  }
#else
  __trap();  // built without sm_90a: the host refuses to launch (wide_gemm_available)
#endif
}

}  // namespace

bool wide_gemm_available(int device) {
  int major = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "wide_gemm");
  cudaFuncAttributes attr{};
  check_cuda(cudaFuncGetAttributes(&attr, wide_gemm_kernel<__nv_bfloat16, false>), "wide_gemm");
  return major == 9 && attr.binaryVersion == 90;
}

void wide_gemm(void* y, const void* x, const void* w, float* partials, int* counters, int64_t M, int64_t N, int64_t K,
               int splits, bool silu_mul, DType dtype, std::uintptr_t stream) {
  if (M < 1 || M > kWideMaxM) throw std::invalid_argument("wide_gemm: M must be in 1..64");
  if (K % 8 != 0 || K < 8) throw std::invalid_argument("wide_gemm: K must be a positive multiple of 8");
  if (N < 1 || splits < 1) throw std::invalid_argument("wide_gemm: N and splits must be >= 1");
  if (silu_mul && N % 16 != 0) throw std::invalid_argument("wide_gemm: the SiLU epilogue needs N % 16 == 0");
  if (splits > 1 && (partials == nullptr || counters == nullptr))
    throw std::invalid_argument("wide_gemm: split-K needs partials and counters");
  const int total = static_cast<int>((K + kKStage - 1) / kKStage);
  const int per_split = (total + splits - 1) / splits;
  splits = (total + per_split - 1) / per_split;  // no empty split
  const dim3 grid(static_cast<unsigned>((N + kRows - 1) / kRows), static_cast<unsigned>(splits));
  dispatch_float<false>(dtype, "wide_gemm", [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      static const bool sized = [&] {  // once per kernel: more than 48 KB of dynamic shared memory
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
                   "wide_gemm: shared-memory limit");
        return true;
      }();
      (void)sized;
      launch_pdl("wide_gemm", kernel, grid, dim3(kThreads), kSmemBytes, as_stream(stream), static_cast<T*>(y),
                 static_cast<const T*>(x), static_cast<const T*>(w), partials, counters, static_cast<int>(M),
                 static_cast<int>(N), static_cast<int>(K), per_split);
    };
    if (silu_mul) launch(wide_gemm_kernel<T, true>);
    else launch(wide_gemm_kernel<T, false>);
  });
  check_launch("wide_gemm");
}

}  // namespace candle_vllm::cuda
