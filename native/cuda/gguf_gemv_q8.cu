// Decode GEMV against int8 activations: y[M, N] = x[M, K] @ W[N, K]^T for M <= 8, W in GGUF blocks.
//
// Two launches on the caller's stream. The first quantizes each 32-element block of x to int8 codes with scale
// amax / 127 (IEEE division and rounding half away from zero, as the CPU kernels do) plus per-half code sums; it
// can be a programmatic dependent of the op that produced x (GgufGemvQ8Config::pdl_quantizer). The second
// streams W, always as a programmatic dependent of the quantizer: it fetches its first weights while the
// quantizer runs, and lets the next kernel launch early.
//
// A CTA owns row groups of kRows weight rows (one group, or several in turn on a grid of a few CTAs per SM);
// within a group its threads walk the rows' blocks together, each taking one Part of a block (gguf_q8.cuh) for
// all kRows rows at once, so each activation load serves every row. An item is one such round: one Part per row
// per thread. Products are integer dp4a sums scaled per block in f32; a group ends with warp shuffles and one
// shared-memory step. Weights reach the threads one of two ways:
//  - direct: each thread loads its parts straight from global memory into registers, kDepth items ahead of the
//    item it multiplies (kDepth 0: loaded and used at once);
//  - staged: the CTA copies each item's contiguous byte span of every row into shared memory with 16-byte
//    cp.async (stages - 1 items ahead), then threads decode their parts from there; the one layout that gives
//    the 2-byte aligned types (Q4_0, Q5_0, Q8_0, Q6_K) full-width coalesced loads.
// The int8 activations (K bytes per token) are read from global memory and stay in L1, shared by all CTAs of an SM.
#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/gguf.h"
#include "cuda/gguf_q8.cuh"

namespace candle_vllm::cuda {
namespace {

using gguf::XBlock;
constexpr int kMaxThreads = 256;
constexpr int kDefaultThreads = 128;

// Eight threads per 32-element block, four elements each.
template <typename T>
__global__ void __launch_bounds__(256) quantize_x_kernel(const T* __restrict__ x, int8_t* __restrict__ xq,
                                                        XBlock* __restrict__ xb, int64_t blocks) {
  // x comes from the previous kernel (and the previous GEMV may still read xq) when launched as a dependent.
  pdl_wait();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = i >> 3;
  const bool live = blk < blocks;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  if (live) {
    const Vec<T, 4> in = *reinterpret_cast<const Vec<T, 4>*>(x + 4 * i);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = to_f32(in.v[j]);
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
  uint32_t packed = 0;
  int sum = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float s = __fmul_rn(v[j], inv);
    const int q = static_cast<int>(truncf(__fadd_rn(s, s >= 0.f ? 0.5f : -0.5f)));
    sum += q;
    packed |= (static_cast<uint32_t>(q) & 0xFF) << (8 * j);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);  // lanes 0-3 hold the first half's sum, 4-7 the second's
  const int upper = __shfl_down_sync(0xffffffffu, sum, 4);
  if (!live) return;
  reinterpret_cast<uint32_t*>(xq)[i] = packed;
  if ((i & 7) == 0) {
    XBlock b;
    b.d = __fdiv_rn(amax, 127.f);
    b.sum[0] = static_cast<int16_t>(sum);
    b.sum[1] = static_cast<int16_t>(upper);
    xb[blk] = b;
  }
  // The GEMV may start now: it streams its first weights while this grid ends and waits before reading xq.
  pdl_launch_dependents();
}

// What every GEMV kernel gets.
struct Args {
  void* y;
  bool bf16;
  const int8_t* xq;
  const XBlock* xb;
  const uint8_t* w;
  int rows_m, N, K;
  int64_t row_bytes;
};

// A CTA's walk over its items: group g (row group, strided by gridDim.x) and round j within the group.
struct Cursor {
  int g, j;
  __device__ __forceinline__ void next(int rounds) {
    if (++j == rounds) j = 0, g += gridDim.x;
  }
};

// Per-CTA geometry shared by both kernels.
template <class Q, int R>
struct Walk {
  int slots, rounds, total;  // parts per row, items per group, items of this CTA
  __device__ __forceinline__ explicit Walk(const Args& a) {
    slots = a.K / Q::kBlockElems * Q::kParts;
    rounds = (slots + blockDim.x - 1) / blockDim.x;
    const int groups = (a.N + R - 1) / R;
    total = (groups - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x * rounds;
  }
};

// Start of weight row `row` (rows past N re-read the last one; their sums are dropped).
__device__ __forceinline__ const uint8_t* row_ptr(const Args& a, int row) {
  return a.w + static_cast<int64_t>(min(row, a.N - 1)) * a.row_bytes;
}

// acc[r][m] += the activation row m's products with the decoded parts of block b.
template <class Q, int M, int R>
__device__ __forceinline__ void multiply(float (&acc)[R][M], const Q (&part)[R], const Args& a, int b, int p) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int t = min(m, a.rows_m - 1);  // rows past M re-read the last one; their sums are dropped
    typename Q::X xv;
    Q::load_x(xv, a.xq + static_cast<int64_t>(t) * a.K + b * Q::kBlockElems,
              a.xb + static_cast<int64_t>(t) * (a.K / 32) + b * (Q::kBlockElems / 32), p);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][m] += part[r].dot(xv);
  }
}

// Sums acc over the CTA, writes the group's outputs and clears acc. red is double-buffered by group parity, so
// one barrier per group suffices (the buffer is rewritten only after the next group's barrier).
template <int M, int R>
__device__ __forceinline__ void finish_group(float (&acc)[R][M], float (*red)[kMaxThreads / 32][R * M], int& parity,
                                             const Args& a, int g) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = warp_sum(acc[r][m]);
      if (lane == 0) red[parity][warp][r * M + m] = v;
      acc[r][m] = 0.f;
    }
  __syncthreads();
  if (threadIdx.x < R * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M, row = g * R + r;
    float v = 0.f;
    for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) v += red[parity][i][threadIdx.x];
    if (row < a.N && m < a.rows_m) {
      const int64_t at = static_cast<int64_t>(m) * a.N + row;
      if (a.bf16) static_cast<__nv_bfloat16*>(a.y)[at] = __float2bfloat16_rn(v);
      else static_cast<__half*>(a.y)[at] = __float2half_rn(v);
    }
  }
  parity ^= 1;
}

template <class Q, int M, int R, int kDepth>
__global__ void __launch_bounds__(kMaxThreads) gemv_direct_kernel(Args a) {
  __shared__ float red[2][kMaxThreads / 32][R * M];
  const Walk<Q, R> walk(a);
  const int tid = threadIdx.x, T = blockDim.x;
  using Raw = typename Q::Raw;
  auto fetch = [&](Raw (&raw)[R], const Cursor& c) {
    const int s = min(c.j * T + tid, walk.slots - 1);
    const int64_t off = static_cast<int64_t>(s / Q::kParts) * Q::kBlockBytes;
#pragma unroll
    for (int r = 0; r < R; ++r) Q::template fetch<true>(raw[r], row_ptr(a, c.g * R + r) + off, s % Q::kParts);
  };
  constexpr int kRing = kDepth > 0 ? kDepth : 1;
  Raw ring[kRing][R];
  Cursor ahead{static_cast<int>(blockIdx.x), 0}, at = ahead;
  // The first weights do not depend on the activation quantizer: fetch them, then wait for its grid.
#pragma unroll
  for (int d = 0; d < kRing; ++d)
    if (d < walk.total) fetch(ring[d], ahead), ahead.next(walk.rounds);
  pdl_wait();
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  int parity = 0;
  for (int base = 0; base < walk.total; base += kRing) {
#pragma unroll
    for (int d = 0; d < kRing; ++d) {
      const int i = base + d;
      if (i >= walk.total) break;
      Q part[R];
      if constexpr (kDepth == 0) {  // this item was fetched just now (or before the wait)
#pragma unroll
        for (int r = 0; r < R; ++r) part[r].decode(ring[d][r]);
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r) part[r].decode(ring[d][r]);
        if (i + kRing < walk.total) fetch(ring[d], ahead), ahead.next(walk.rounds);
      }
      const int s = at.j * T + tid;
      if (s < walk.slots) multiply<Q, M, R>(acc, part, a, s / Q::kParts, s % Q::kParts);
      if constexpr (kDepth == 0)
        if (i + 1 < walk.total) fetch(ring[d], ahead), ahead.next(walk.rounds);
      if (at.j == walk.rounds - 1) finish_group<M, R>(acc, red, parity, a, at.g);
      at.next(walk.rounds);
    }
  }
  pdl_launch_dependents();  // after the last group: the next kernel's prologue overlaps this grid's tail
}

// 16 bytes global -> shared; only the first `bytes` are read, the rest of the destination is zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  const auto d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Bytes of one row's span per stage: the item's blocks plus the offset from the 16-byte boundary below them.
template <class Q>
__host__ __device__ constexpr int staged_row_stride(int threads) {
  return (threads / Q::kParts * Q::kBlockBytes + 15 + 15) / 16 * 16;
}

template <class Q, int M, int R>
__global__ void __launch_bounds__(kMaxThreads) gemv_staged_kernel(Args a, int stages) {
  extern __shared__ __align__(16) uint8_t tiles[];
  __shared__ float red[2][kMaxThreads / 32][R * M];
  const Walk<Q, R> walk(a);
  const int tid = threadIdx.x, T = blockDim.x;
  const int tile_blocks = T / Q::kParts, nblocks = a.K / Q::kBlockElems;
  const int stride = staged_row_stride<Q>(T);
  // Row r's span of item c: its first byte in global memory and how many bytes.
  auto span = [&](const Cursor& c, int r, int& bytes) {
    const int b0 = c.j * tile_blocks;
    bytes = min(tile_blocks, nblocks - b0) * Q::kBlockBytes;
    return row_ptr(a, c.g * R + r) + static_cast<int64_t>(b0) * Q::kBlockBytes;
  };
  auto issue = [&](const Cursor& c, int stage) {
    uint8_t* dst = tiles + stage * R * stride;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      int bytes;
      const uint8_t* src = span(c, r, bytes);
      const uint8_t* lo = reinterpret_cast<const uint8_t*>(reinterpret_cast<std::uintptr_t>(src) & ~std::uintptr_t{15});
      const uint8_t* end = src + bytes;
      const int chunks = static_cast<int>((end - lo + 15) / 16);
      for (int k = tid; k < chunks; k += T)
        cp_async16(dst + r * stride + 16 * k, lo + 16 * k, static_cast<int>(min(int64_t{16}, end - (lo + 16 * k))));
    }
  };
  Cursor ahead{static_cast<int>(blockIdx.x), 0}, at = ahead;
  for (int st = 0; st < stages - 1; ++st) {
    if (st < walk.total) issue(ahead, st), ahead.next(walk.rounds);
    cp_async_commit();  // empty groups keep the count uniform
  }
  pdl_wait();
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  int parity = 0;
  for (int i = 0; i < walk.total; ++i) {
    switch (stages) {  // item i has landed once at most stages - 2 later groups are pending
      case 2: cp_async_wait<0>(); break;
      case 3: cp_async_wait<1>(); break;
      default: cp_async_wait<2>(); break;
    }
    __syncthreads();  // everyone's copies of item i are visible; everyone is done with item i - 1's stage
    if (i + stages - 1 < walk.total) issue(ahead, (i + stages - 1) % stages), ahead.next(walk.rounds);
    cp_async_commit();
    const int s = at.j * T + tid;
    if (s < walk.slots) {
      const int bl = tid / Q::kParts, p = tid % Q::kParts;
      const uint8_t* stage = tiles + (i % stages) * R * stride;
      Q part[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        int bytes;
        const auto off = static_cast<int>(reinterpret_cast<std::uintptr_t>(span(at, r, bytes)) & 15);
        typename Q::Raw raw;
        Q::template fetch<false>(raw, stage + r * stride + off + bl * Q::kBlockBytes, p);
        part[r].decode(raw);
      }
      multiply<Q, M, R>(acc, part, a, s / Q::kParts, p);
    }
    if (at.j == walk.rounds - 1) finish_group<M, R>(acc, red, parity, a, at.g);
    at.next(walk.rounds);
  }
  pdl_launch_dependents();  // after the last group: the next kernel's prologue overlaps this grid's tail
}

// A device attribute of the current device, cached per device.
template <cudaDeviceAttr kAttr>
int device_attr() {
  static std::atomic<int> cached[64];
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "gguf_gemv_q8: cudaGetDevice");
  if (dev < 0 || dev >= 64) dev = 0;
  int n = cached[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    check_cuda(cudaDeviceGetAttribute(&n, kAttr, dev), "gguf_gemv_q8: cudaDeviceGetAttribute");
    cached[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

int sm_count() { return device_attr<cudaDevAttrMultiProcessorCount>(); }

// Grid for `groups` row groups: one CTA each, or ctas_per_sm CTAs per SM walking them in turn.
unsigned grid_for(int groups, int ctas_per_sm) {
  if (ctas_per_sm == 0) return static_cast<unsigned>(groups);
  return static_cast<unsigned>(std::min<int64_t>(groups, static_cast<int64_t>(ctas_per_sm) * sm_count()));
}

template <class Q, int M, int R>
void launch_rows(const Args& a, const GgufGemvQ8Config& c, int threads, cudaStream_t s) {
  const dim3 grid(grid_for((a.N + R - 1) / R, c.ctas_per_sm)), block(threads);
  if (c.stages > 0) {
    const int smem = c.stages * R * staged_row_stride<Q>(threads);
    auto* k = gemv_staged_kernel<Q, M, R>;
    const int red_bytes = static_cast<int>(sizeof(float)) * 2 * (kMaxThreads / 32) * R * M;
    const int limit = device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>() - red_bytes;
    if (smem > limit)
      throw std::invalid_argument("gguf_gemv_q8: " + std::to_string(c.stages) + " stages of " + std::to_string(R) +
                                  " rows need " + std::to_string(smem) + " bytes of shared memory, more than this "
                                  "device allows; use fewer stages, rows or threads");
    if (smem > 48 * 1024)
      check_cuda(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "gguf_gemv_q8: smem");
    launch_pdl("gguf_gemv_q8 (staged)", k, grid, block, static_cast<size_t>(smem), s, a, c.stages);
    return;
  }
  switch (c.depth) {
    case 0: launch_pdl("gguf_gemv_q8", gemv_direct_kernel<Q, M, R, 0>, grid, block, 0, s, a); return;
    case 1: launch_pdl("gguf_gemv_q8", gemv_direct_kernel<Q, M, R, 1>, grid, block, 0, s, a); return;
    default: launch_pdl("gguf_gemv_q8", gemv_direct_kernel<Q, M, R, 2>, grid, block, 0, s, a); return;
  }
}

// The types whose rows-per-CTA can be swept (the benchmarked ones); the others build only their default.
template <class Q>
constexpr bool kSweepRows = std::is_same_v<Q, gguf::Q8Dot<gguf::Q4_0>> || std::is_same_v<Q, gguf::Q8Dot<gguf::Q8_0>> ||
                            std::is_same_v<Q, gguf::Q8Dot<gguf::Q4_K>> || std::is_same_v<Q, gguf::Q8Dot<gguf::Q6_K>>;

// Rows per CTA from a measured sweep (benches/RESULTS.md): per type at one token (Q::kRowsAtM1), 2 at two
// tokens, 4 from four tokens up (each activation load then serves 4 rows).
template <class Q, int M>
constexpr int kDefaultRows = M == 1 ? Q::kRowsAtM1 : M == 2 ? 2 : 4;

template <class Q, int M>
void launch_m(const Args& a, const GgufGemvQ8Config& c, int threads, cudaStream_t s) {
  constexpr int def = kDefaultRows<Q, M>;
  const int rows = c.rows > 0 ? c.rows : def;
  if constexpr (kSweepRows<Q>) {
    switch (rows) {
      case 1: return launch_rows<Q, M, 1>(a, c, threads, s);
      case 2: return launch_rows<Q, M, 2>(a, c, threads, s);
      case 4: return launch_rows<Q, M, 4>(a, c, threads, s);
      case 8:
        if constexpr (M <= 2) return launch_rows<Q, M, 8>(a, c, threads, s);
        break;
      default: break;
    }
    throw std::invalid_argument("gguf_gemv_q8: rows per CTA must be 1, 2, 4 (or 8 for M <= 2), got " +
                                std::to_string(rows));
  } else {
    if (rows != def)
      throw std::invalid_argument("gguf_gemv_q8: this type is built only with its default " + std::to_string(def) +
                                  " rows per CTA at this M (rows can be swept for Q4_0, Q8_0, Q4_K, Q6_K)");
    launch_rows<Q, M, def>(a, c, threads, s);
  }
}

void check_config(const GgufGemvQ8Config& c) {
  if (c.threads != 0 && c.threads != 64 && c.threads != 128 && c.threads != 256)
    throw std::invalid_argument("gguf_gemv_q8: threads per CTA must be 64, 128 or 256 (0: default)");
  if (c.depth < 0 || c.depth > 2) throw std::invalid_argument("gguf_gemv_q8: depth must be 0, 1 or 2");
  if (c.stages != 0 && (c.stages < 2 || c.stages > 4))
    throw std::invalid_argument("gguf_gemv_q8: stages must be 0 (direct loads) or 2..4 (staged)");
  if (c.stages != 0 && c.depth != 0) throw std::invalid_argument("gguf_gemv_q8: depth applies to direct loads only");
  if (c.ctas_per_sm < 0 || c.ctas_per_sm > 32) throw std::invalid_argument("gguf_gemv_q8: ctas_per_sm must be 0..32");
  if (c.rows < 0) throw std::invalid_argument("gguf_gemv_q8: rows must be >= 0");
}

}  // namespace

bool gguf_gemv_q8_supported(int qtype) {
  return gguf::dispatch_q8(qtype, [](auto) {});
}

void gguf_gemv_q8(void* y, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M, int64_t N, int64_t K,
                  int qtype, DType dtype, std::uintptr_t stream, const GgufGemvQ8Config& config) {
  if (M < 1 || M > kGgufGemvMaxM) throw std::invalid_argument("gguf_gemv_q8: M must be in 1..8");
  if (N < 1 || K < 1 || N > INT32_MAX || K > INT32_MAX / 8) throw std::invalid_argument("gguf_gemv_q8: bad N or K");
  if (K % 32 != 0) throw std::invalid_argument("gguf_gemv_q8: K must be a multiple of 32");
  if (!aligned16(w, xq, x) || reinterpret_cast<std::uintptr_t>(xb) % 8 != 0)
    throw std::invalid_argument("gguf_gemv_q8: w, x and xq must be 16-byte aligned, xb 8-byte aligned");
  if (dtype != DType::F16 && dtype != DType::BF16) throw std::invalid_argument("gguf_gemv_q8: dtype must be f16 or bf16");
  check_config(config);
  if (!gguf_gemv_q8_supported(qtype))
    throw std::invalid_argument("gguf_gemv_q8: no int8-activation kernel for GGUF type " + std::to_string(qtype));
  const cudaStream_t s = as_stream(stream);
  const int64_t blocks = M * K / 32;
  auto* xbp = static_cast<XBlock*>(xb);
  dispatch_float<false>(dtype, "gguf_gemv_q8", [&](auto t) {
    using T = decltype(t);
    const unsigned grid = static_cast<unsigned>((blocks * 8 + 255) / 256);
    if (config.pdl_quantizer)
      launch_pdl("gguf_gemv_q8: quantize activations", quantize_x_kernel<T>, dim3(grid), dim3(256), 0, s,
                 static_cast<const T*>(x), xq, xbp, blocks);
    else
      quantize_x_kernel<T><<<grid, 256, 0, s>>>(static_cast<const T*>(x), xq, xbp, blocks);
  });
  check_launch("gguf_gemv_q8: quantize activations");
  const Args a{y, dtype == DType::BF16, xq, xbp, w, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), 0};
  const int threads = config.threads > 0 ? config.threads : kDefaultThreads;
  gguf::dispatch_q8(qtype, [&](auto tag) {
    using Q = decltype(tag);
    if (K % Q::kBlockElems != 0) throw std::invalid_argument("gguf_gemv_q8: K must be a whole number of blocks");
    Args b = a;
    b.row_bytes = K / Q::kBlockElems * Q::kBlockBytes;
    if (M == 1) launch_m<Q, 1>(b, config, threads, s);
    else if (M == 2) launch_m<Q, 2>(b, config, threads, s);
    else if (M <= 4) launch_m<Q, 4>(b, config, threads, s);
    else launch_m<Q, 8>(b, config, threads, s);
  });
  check_launch("gguf_gemv_q8");
}

}  // namespace candle_vllm::cuda
