// Fused GGUF dequantize + GEMV for decode batches (M <= 8): y[M, N] = x[M, K] @ W[N, K]^T, W in GGUF blocks.
//
// A CTA owns 16 weight rows; its 4 warps take turns over the row's 256-element units (8 blocks of the 32-element
// types, one block of the K types). A warp copies a unit's bytes for its 16 rows into shared memory with
// 16-byte cp.async (blocks are 18..210 bytes, so each row's window starts at the 16-byte boundary below it),
// kStages units ahead, so each quantized byte crosses HBM once, in wide loads, with plenty in flight. It then
// decodes each row's codes straight into f16/bf16 pairs (magic-number conversion: code | 0x6400 is 1024 + code
// as f16, code | 0x4300 is 128 + code as bf16; exact) and feeds them to mma.m16n8k16 as the A operand, x as B:
// tensor cores do the multiply-adds for all M tokens, f32 accumulate. The k order inside an mma is free, so the
// decoders (gguf_decode.cuh) hand each lane pairs of adjacent elements that need few scales, and x is fetched
// as the matching aligned 4-byte pairs. Warps are reduced through shared memory.
#include "cuda/common.cuh"
#include "cuda/gguf.h"
#include "cuda/gguf_decode.cuh"
#include "cuda/mma.cuh"

#include <atomic>
#include <type_traits>

namespace candle_vllm::cuda {
namespace {

constexpr int kWarps = 4, kStages = 4, kRows = 16;

// Q6_K and Q3_K in the CUDA layout (gguf_block.cuh) keep a block's d (and Q3_K's scales) in its group's header, outside
// the window a unit's copy takes: their units are decoded from global memory in place (this kernel is a non-default
// choice; the dp4a GEMV is their decode path).
template <class D>
constexpr bool kInPlace = std::is_same_v<D, gguf::Deq<gguf::Q6_K>> || std::is_same_v<D, gguf::Deq<gguf::Q3_K>>;

template <class D>
struct Layout {
  static constexpr int kUnitBlocks = gguf::kUnitElems / D::kBlockElems;
  static constexpr int kUnitBytes = kUnitBlocks * D::kBlockBytes;
  static constexpr int kSlotRow = (kUnitBytes + 15 + 15) / 16 * 16;  // window from the 16-byte boundary below
  static constexpr int kChunks = kSlotRow / 16;
  static constexpr int kWarpBytes = kStages * kRows * kSlotRow;
  static constexpr int kSmemBytes = kWarps * kWarpBytes;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* src, int src_bytes) {
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// The chunk of a 16-byte window that ends the weight tensor: its n < 16 bytes by byte loads, the rest zero, so no
// read reaches past the tensor's last byte (Compute Sanitizer's memcheck reports a 16-byte cp.async there as a
// read past the allocation even with the smaller source size).
__device__ __forceinline__ void copy_tail(uint8_t* smem, const uint8_t* src, int n) {
#pragma unroll
  for (int b = 0; b < 16; ++b) smem[b] = b < n ? __ldg(src + b) : uint8_t{0};
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <typename T>
struct Pair;
template <>
struct Pair<__half> {
  using T2 = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // 1024.0 in both halves
  static constexpr float kMagicValue = 1024.f;
};
template <>
struct Pair<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;  // 128.0 in both halves
  static constexpr float kMagicValue = 128.f;
};

template <typename T>
__device__ __forceinline__ typename Pair<T>::T2 splat(float v) {
  if constexpr (std::is_same_v<T, __half>) return __float2half2_rn(v);
  else return __float2bfloat162_rn(v);
}

template <typename T>
__device__ __forceinline__ uint32_t bits(typename Pair<T>::T2 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// Whether the codes of D fit the magic-number conversion of T (bf16 holds 128 + code exactly up to 7 bits).
template <typename T, class D>
constexpr bool kMagicFits = std::is_same_v<T, __half> ? D::kCodeBits <= 10 : D::kCodeBits <= 7;

// One pair of weights (code - offset) * a + b as a packed T2.
template <typename T, class D>
__device__ __forceinline__ uint32_t weight_pair(uint32_t code, float a, float b, typename Pair<T>::T2 a2,
                                                typename Pair<T>::T2 b2) {
  using P = Pair<T>;
  if constexpr (kMagicFits<T, D>) {
    const uint32_t biased = code | P::kMagic;
    const auto c = __hsub2(*reinterpret_cast<const typename P::T2*>(&biased), splat<T>(P::kMagicValue + D::kOffset));
    return bits<T>(__hfma2(c, a2, b2));
  } else {  // Q8_0 codes in bf16: exact through f32 (2^23 + code as f32), one rounding
    const float lo = __uint_as_float(0x4B000000u | (code & 0xFFFF)) - (8388608.f + D::kOffset);
    const float hi = __uint_as_float(0x4B000000u | (code >> 16)) - (8388608.f + D::kOffset);
    return bits<T>(__floats2bfloat162_rn(fmaf(lo, a, b), fmaf(hi, a, b)));
  }
}

template <typename T, class D>
struct RowScales {
  float a[4], b[4];
  typename Pair<T>::T2 a2[4], b2[4];
  __device__ __forceinline__ void load(const uint8_t* unit, int s, int t) {
    D::scales(unit, s, t, a, b);
#pragma unroll
    for (int j = 0; j < 4; ++j) a2[j] = splat<T>(a[j]), b2[j] = splat<T>(b[j]);
  }
  __device__ __forceinline__ void weights(const uint8_t* unit, int s, int t, uint32_t (&w)[4]) const {
    uint32_t c[4];
    D::codes(unit, s, t, c);
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = weight_pair<T, D>(c[j], a[j], b[j], a2[j], b2[j]);
  }
};

template <typename T, class D>
__global__ void __launch_bounds__(kWarps * 32) gguf_gemv_kernel(T* __restrict__ y, const T* __restrict__ x,
                                                                const uint8_t* __restrict__ w, int M, int N, int K,
                                                                int64_t row_bytes, int blocks_per_row) {
  using L = Layout<D>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * kRows;
  uint8_t* slots = smem + warp * L::kWarpBytes;
  const int units = (blocks_per_row + L::kUnitBlocks - 1) / L::kUnitBlocks;
  const int my_units = warp < units ? (units - warp + kWarps - 1) / kWarps : 0;

  // Rows past N re-read row N-1 (in bounds); their results are dropped.
  const int64_t tensor_bytes = static_cast<int64_t>(N) * row_bytes;
  auto unit_offset = [&](int r, int u) -> int64_t {
    return static_cast<int64_t>(min(row0 + r, N - 1)) * row_bytes + static_cast<int64_t>(u) * L::kUnitBytes;
  };
  auto issue = [&](int i) {
    if constexpr (kInPlace<D>) return;
    const int u = warp + i * kWarps;
    uint8_t* slot = slots + (i % kStages) * kRows * L::kSlotRow;
    const int64_t left = row_bytes - static_cast<int64_t>(u) * L::kUnitBytes;
    const int unit_bytes = left < L::kUnitBytes ? static_cast<int>(left) : L::kUnitBytes;
    for (int c = lane; c < kRows * L::kChunks; c += 32) {
      const int r = c / L::kChunks, q = c % L::kChunks;
      const int64_t o = unit_offset(r, u), at = (o & ~int64_t{15}) + q * 16;
      const int need = static_cast<int>(o & 15) + unit_bytes - q * 16;
      if (need <= 0) continue;
      if (at + 16 <= tensor_bytes) cp_async16(slot + r * L::kSlotRow + q * 16, w + at, min(16, need));
      else copy_tail(slot + r * L::kSlotRow + q * 16, w + at, need);
    }
  };

  const T* xg = x + static_cast<size_t>(min(g, M - 1)) * K;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};

#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < my_units) issue(i);
    cp_async_commit();
  }
  for (int i = 0; i < my_units; ++i) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    const int u = warp + i * kWarps;
    const uint8_t* slot = slots + (i % kStages) * kRows * L::kSlotRow;
    auto window = [&](int r) {  // row r's unit: its window in shared memory, or in place
      return kInPlace<D> ? w + unit_offset(r, u) : slot + r * L::kSlotRow + (unit_offset(r, u) & 15);
    };
    const uint8_t* lo = window(g);
    const uint8_t* hi = window(g + 8);
    const T* xu = xg + static_cast<size_t>(u) * gguf::kUnitElems;
    const int steps = min(L::kUnitBlocks, blocks_per_row - u * L::kUnitBlocks) * D::kBlockElems / 32;
    RowScales<T, D> s_lo, s_hi;
    if constexpr (!D::kScalesPerStep) s_lo.load(lo, 0, t), s_hi.load(hi, 0, t);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (s >= steps) break;
      if constexpr (D::kScalesPerStep) s_lo.load(lo, s, t), s_hi.load(hi, s, t);
      uint32_t wl[4], wh[4], xb[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) xb[j] = __ldg(reinterpret_cast<const uint32_t*>(xu + D::elem(s, t, j)));
      s_lo.weights(lo, s, t, wl);
      s_hi.weights(hi, s, t, wh);
      mma_16816<T>(acc, {wl[0], wh[0], wl[1], wh[1]}, xb[0], xb[1]);
      mma_16816<T>(acc, {wl[2], wh[2], wl[3], wh[3]}, xb[2], xb[3]);
    }
    __syncwarp();  // every lane is done with this slot before it is refilled
    if (i + kStages - 1 < my_units) issue(i + kStages - 1);
    cp_async_commit();
  }
  cp_async_wait<0>();

  __shared__ float red[kWarps][4][32];
#pragma unroll
  for (int i = 0; i < 4; ++i) red[warp][i][lane] = acc[i];
  __syncthreads();
  // Accumulator layout: c0, c1 = (row g, tokens 2t, 2t+1); c2, c3 = (row g+8, same tokens).
  const int i = threadIdx.x >> 5, l = threadIdx.x & 31;
  const int row = row0 + (l >> 2) + (i >= 2 ? 8 : 0), token = (l & 3) * 2 + (i & 1);
  float sum = 0.f;
#pragma unroll
  for (int v = 0; v < kWarps; ++v) sum += red[v][i][l];
  if (row < N && token < M) y[static_cast<size_t>(token) * N + row] = from_f32<T>(sum);
}

template <typename T, class D>
void launch(T* y, const T* x, const uint8_t* w, int M, int N, int K, int qtype, cudaStream_t stream) {
  using L = Layout<D>;
  auto kernel = gguf_gemv_kernel<T, D>;
  // The shared-memory limit is raised once per device (a host-side attribute, fine during graph capture).
  static std::atomic<uint64_t> raised{0};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "gguf_gemv: current device");
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(raised.load() & bit)) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmemBytes),
               "gguf_gemv: shared memory limit");
    raised.fetch_or(bit);
  }
  const int blocks_per_row = K / D::kBlockElems;
  const int64_t row_bytes = gguf::row_bytes(qtype, K);
  const dim3 grid(static_cast<unsigned>((N + kRows - 1) / kRows));
  kernel<<<grid, kWarps * 32, L::kSmemBytes, stream>>>(y, x, w, M, N, K, row_bytes, blocks_per_row);
}

}  // namespace

void gguf_gemv(void* y, const void* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int qtype, DType dtype,
               std::uintptr_t stream) {
  if (M < 1 || M > kGgufGemvMaxM) throw std::invalid_argument("gguf_gemv: M must be in 1..8");
  if (N < 1 || K < 1 || N > INT32_MAX || K > INT32_MAX) throw std::invalid_argument("gguf_gemv: bad N or K");
  if (!aligned16(w) || reinterpret_cast<std::uintptr_t>(x) % 4 != 0)
    throw std::invalid_argument("gguf_gemv: w must be 16-byte and x 4-byte aligned");
  const bool known = gguf::dispatch_qtype(qtype, [&](auto tag) {
    using D = decltype(tag);
    if (K % D::kBlockElems != 0) throw std::invalid_argument("gguf_gemv: K must be a whole number of blocks");
    dispatch_float<false>(dtype, "gguf_gemv", [&](auto t) {
      using T = decltype(t);
      launch<T, D>(static_cast<T*>(y), static_cast<const T*>(x), w, static_cast<int>(M), static_cast<int>(N),
                   static_cast<int>(K), qtype, as_stream(stream));
    });
  });
  if (!known) throw std::invalid_argument("gguf_gemv: unsupported GGUF type " + std::to_string(qtype));
  check_launch("gguf_gemv");
}

}  // namespace candle_vllm::cuda
