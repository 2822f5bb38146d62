// Decode GEMM for 17..64 tokens on Hopper: y[M, N] = x[M, K] @ W[N, K]^T with every weight byte read once.
//
// At 64 tokens a decode linear is still bound by reading W (64 FLOP per weight byte, a quarter of the tensor
// cores' rate). A CTA here owns 256 weight rows and runs alone on its SM:
// - one warp only issues TMA copies (128B-swizzled K-major boxes of 64 k: a 128-byte row per weight row and per
//   token) into a ring of 5 stages of 40 KB; two warpgroups multiply each stage with wgmma.m64n64k16 (W as the A
//   operand, 128 rows each; the 64 tokens as B, rows past M zero-filled by TMA), with a full/empty mbarrier pair
//   per stage;
// - under programmatic dependent launch the ring's weight boxes are requested before waiting for the kernel that
//   writes x, the token boxes after it;
// - the f32 tile goes through shared memory so y is written in 16-byte runs, with the SwiGLU of a gate/up weight
//   interleaved in groups of 8 rows (ops.activation) applied on the way.
// It is dispatched for weights of more 256-row tiles than SMs (the LM head), which it streams at ~95 % of the
// copy ceiling in several full waves where cuBLASLt reaches 87-94 %. On the narrower decode weights a one-wave
// grid of such CTAs, split-K or not, was slower than cuBLASLt (benches/RESULTS.md, 2026-12-02, session 16).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/mbarrier.cuh"
#include "cuda/smem_pipe.cuh"
#include "cuda/wide_gemm.h"

namespace candle_vllm::cuda {
namespace {

constexpr int kKStage = 64;    // K per stage: one 128-byte swizzle row
constexpr int kTokens = 64;    // the wgmma N
constexpr int kConsumers = 2;  // warpgroups that multiply; one more warp issues the copies
constexpr int kBlocks = 2;     // m64 blocks of weight rows per consumer warpgroup
[[maybe_unused]] constexpr int kProducerWarp = kConsumers * 4;
constexpr int kThreads = kConsumers * 128 + 32;
constexpr int kRows = kWideRows;
static_assert(kRows == 64 * kBlocks * kConsumers);
constexpr int kWBytes = kRows * kKStage * 2;
constexpr int kXBytes = kTokens * kKStage * 2;
constexpr int kStageBytes = kWBytes + kXBytes;
constexpr int kStages = (227 * 1024 - 2048) / kStageBytes;  // Hopper's opt-in limit less barriers and alignment
constexpr int kSmemBytes = kStages * kStageBytes + 1024;
constexpr int kRedStride = kRows + 4;  // f32 per token in the output tile; +4 spreads the banks
static_assert(kTokens * kRedStride * 4 <= kStages * kStageBytes, "the f32 tile reuses the ring");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CANDLE_VLLM_WGMMA 1
#endif

#ifdef CANDLE_VLLM_WGMMA
// One box of a 2-D tensor map (coordinates: k, then row) into shared memory, completing bytes on `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap& map, uint32_t bar, int k, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(bar), "r"(k), "r"(row)
      : "memory");
}

// wgmma descriptor of a K-major, 128B-swizzled tile at shared address addr: 8-row groups 1024 B apart (the
// stride byte offset); the leading byte offset is unused for this layout. A k16 step advances addr by 32 B.
__device__ __forceinline__ uint64_t tile_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void fence_accumulators(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define CANDLE_VLLM_WGMMA_64x64x16(TYPE)                                                                            \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                   \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                                      \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "     \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
#define CANDLE_VLLM_ACC32(d)                                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),      \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d += A (64 weight rows x k16) * B (k16 x 64 tokens), both K-major tiles in shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[32], uint64_t a, uint64_t b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(CANDLE_VLLM_WGMMA_64x64x16("bf16") : CANDLE_VLLM_ACC32(d) : "l"(a), "l"(b), "r"(1));
  else
    asm volatile(CANDLE_VLLM_WGMMA_64x64x16("f16") : CANDLE_VLLM_ACC32(d) : "l"(a), "l"(b), "r"(1));
}
#endif

template <typename T, bool kSiluMul>
__global__ void __launch_bounds__(kThreads, 1)
    wide_gemm_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map,
                     T* __restrict__ y, int M, int N, int K) {
#ifdef CANDLE_VLLM_WGMMA
  extern __shared__ unsigned char smem_raw[];
  __shared__ alignas(8) uint64_t full[kStages], empty[kStages];
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;
  float* red = reinterpret_cast<float*>(smem_raw + (base - smem_addr(smem_raw)));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int row0 = blockIdx.x * kRows, count = (K + kKStage - 1) / kKStage;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), kConsumers * 4);
    }
    mbar_fence_init();
  }
  __syncthreads();

  float acc[kBlocks][32];
#pragma unroll
  for (int b = 0; b < kBlocks; ++b)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[b][i] = 0.f;

  if (warp == kProducerWarp) {
    if (lane == 0) {
      auto stage = [](int it) { return (it % kStages) * kStageBytes; };
      auto bar = [&](int it) { return smem_addr(&full[it % kStages]); };
      // The weights do not depend on the kernel before: the whole ring of them is requested before x is.
      const int prologue = min(count, kStages);
      for (int it = 0; it < prologue; ++it) {
        mbar_expect_tx(bar(it), kStageBytes);
        tma_load(base + stage(it), w_map, bar(it), it * kKStage, row0);
      }
      pdl_wait();
      for (int it = 0; it < prologue; ++it) tma_load(base + stage(it) + kWBytes, x_map, bar(it), it * kKStage, 0);
      for (int it = prologue; it < count; ++it) {
        mbar_wait(smem_addr(&empty[it % kStages]), (it / kStages - 1) & 1);
        mbar_expect_tx(bar(it), kStageBytes);
        tma_load(base + stage(it), w_map, bar(it), it * kKStage, row0);
        tma_load(base + stage(it) + kWBytes, x_map, bar(it), it * kKStage, 0);
      }
    } else {
      pdl_wait();  // no thread may reach the trigger below unwaited (the deferred norm's contract, deferred_norm.h)
    }
  } else {
    pdl_wait();  // y may be memory the kernel before still reads
    const int wg = warp >> 2;
    for (int it = 0; it < count; ++it) {
      mbar_wait(smem_addr(&full[it % kStages]), (it / kStages) & 1);
      const uint32_t st = base + (it % kStages) * kStageBytes;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) fence_accumulators(acc[b]);
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < kKStage / 16; ++kk)
#pragma unroll
        for (int b = 0; b < kBlocks; ++b)
          wgmma_64x64x16<T>(acc[b], tile_desc(st + (wg * kBlocks + b) * 8192 + kk * 32),
                            tile_desc(st + kWBytes + kk * 32));
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) fence_accumulators(acc[b]);
      // The previous stage's products are done: each warp hands its buffer back to the producer.
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      if (it > 0 && lane == 0) mbar_arrive(smem_addr(&empty[(it - 1) % kStages]));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) fence_accumulators(acc[b]);
  }
  pdl_launch_dependents();
  __syncthreads();  // every stage has been multiplied: the ring takes the f32 tile [token][row]

  if (warp < kProducerWarp) {
    // acc[b][4j + 0..1]: row r, tokens 8j + 2t + 0..1; acc[b][4j + 2..3]: row r + 8 (r = block row + 16 warp + g).
    const int r = ((warp >> 2) * kBlocks) * 64 + 16 * (warp & 3) + (lane >> 2), t2 = 2 * (lane & 3);
#pragma unroll
    for (int b = 0; b < kBlocks; ++b)
#pragma unroll
      for (int i = 0; i < 32; ++i)
        red[(8 * (i >> 2) + t2 + (i & 1)) * kRedStride + r + b * 64 + ((i & 2) ? 8 : 0)] = acc[b][i];
  }
  __syncthreads();

  if constexpr (!kSiluMul) {
    for (int e = tid; e < M * (kRows / 4); e += kThreads) {
      const int tok = e / (kRows / 4), row = 4 * (e % (kRows / 4)), feat = row0 + row;
      const float4 s = *reinterpret_cast<const float4*>(red + tok * kRedStride + row);
      const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (feat + i < N) y[static_cast<size_t>(tok) * N + feat + i] = from_f32<T>(v[i]);
    }
  } else {
    // Rows 16j..16j+7 are gate features 8j..8j+7 of the tile, rows 16j+8.. their up rows.
    const int half = N / 2;
    for (int e = tid; e < M * (kRows / 8); e += kThreads) {
      const int tok = e / (kRows / 8), f = 4 * (e % (kRows / 8)), row = (f / 8) * 16 + f % 8;
      const float4 g = *reinterpret_cast<const float4*>(red + tok * kRedStride + row);
      const float4 u = *reinterpret_cast<const float4*>(red + tok * kRedStride + row + 8);
      const float gv[4] = {g.x, g.y, g.z, g.w}, uv[4] = {u.x, u.y, u.z, u.w};
      const int feat = row0 / 2 + f;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (feat + i < half)
          y[static_cast<size_t>(tok) * half + feat + i] =
              from_f32<T>(silu_mul(round_to<T>(gv[i]), round_to<T>(uv[i])));
    }
  }
#else
  __trap();  // built without sm_90a: the host refuses to launch (wide_gemm_available)
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found),
               "wide_gemm: cuTensorMapEncodeTiled");
    if (found != cudaDriverEntryPointSuccess || p == nullptr)
      throw std::runtime_error("wide_gemm: the driver has no cuTensorMapEncodeTiled (needs CUDA 12+)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// [rows, K] row-major f16/bf16 as boxes of `box_rows` x 64 k, 128B-swizzled; reads past the edges give zeros.
CUtensorMap tile_map(const void* ptr, int64_t rows, int64_t K, int box_rows, DType dtype) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K) * 2};
  const cuuint32_t box[2] = {kKStage, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult r = encode_tiled()(
      &map, dtype == DType::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(ptr), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw std::runtime_error("wide_gemm: cuTensorMapEncodeTiled failed (" + std::to_string(r) + ")");
  return map;
}

template <typename T, bool kSiluMul>
void launch(void* y, const void* x, const void* w, int M, int N, int K, DType dtype, cudaStream_t stream) {
  auto kernel = wide_gemm_kernel<T, kSiluMul>;
  static const bool sized = [&] {  // once per kernel: more than 48 KB of dynamic shared memory
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
               "wide_gemm: shared-memory limit");
    return true;
  }();
  (void)sized;
  launch_pdl("wide_gemm", kernel, dim3((N + kRows - 1) / kRows), dim3(kThreads), kSmemBytes, stream,
             tile_map(w, N, K, kRows, dtype), tile_map(x, M, K, kTokens, dtype), static_cast<T*>(y), M, N, K);
}

}  // namespace

bool wide_gemm_available(int device) {
  int major = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "wide_gemm");
  cudaFuncAttributes attr{};
  check_cuda(cudaFuncGetAttributes(&attr, wide_gemm_kernel<__nv_bfloat16, false>), "wide_gemm");
  return major == 9 && attr.binaryVersion == 90;
}

void wide_gemm(void* y, const void* x, const void* w, int64_t M, int64_t N, int64_t K, bool silu_mul, DType dtype,
               std::uintptr_t stream) {
  if (M < 1 || M > kWideMaxM) throw std::invalid_argument("wide_gemm: M must be in 1..64");
  if (K % 8 != 0 || K < 8 || K >= (int64_t{1} << 31)) throw std::invalid_argument("wide_gemm: K must be a positive multiple of 8");
  if (N < 1 || N >= (int64_t{1} << 31)) throw std::invalid_argument("wide_gemm: N must be in 1..2^31-1");
  if (silu_mul && N % 16 != 0) throw std::invalid_argument("wide_gemm: the SiLU epilogue needs N % 16 == 0");
  if (!aligned16(x, w, y)) throw std::invalid_argument("wide_gemm: x, w and y must be 16-byte aligned");
  dispatch_float<false>(dtype, "wide_gemm", [&](auto tag) {
    using T = decltype(tag);
    const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
    if (silu_mul) launch<T, true>(y, x, w, m, n, k, dtype, as_stream(stream));
    else launch<T, false>(y, x, w, m, n, k, dtype, as_stream(stream));
  });
}

}  // namespace candle_vllm::cuda
