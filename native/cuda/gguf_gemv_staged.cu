// One-token dp4a GEMV for Q4_K/Q5_K with the weights staged through shared memory by the Hopper bulk copy.
//
// Why: the unstaged kernel (gguf_gemv_q8.cu) keeps its weight loads in registers, so an SM has only as many bytes
// in flight as its resident threads hold (R = 8: 127 registers, 4 CTAs, ~64 KB), short of what HBM latency
// needs; q4k streams at 42-67 % of bandwidth where q8_0 reaches 92 %. Here one elected thread per CTA copies
// whole K-chunks of the CTA's R rows into shared memory (cp.async.bulk, completion counted in bytes on an
// mbarrier per stage), `S` chunks in flight, the first ones issued before pdl_wait (the weights do not depend on
// the kernel before). A chunk is kChunkBlocks = 16 super-blocks of every row, one slot per thread (16 blocks x 8
// Parts = 128 slots), so thread t decodes slot c * 128 + t of chunk c: the default launch's slot -> thread
// assignment and per-thread order. The words decoded from shared memory are the global ones, the dot products
// and the reduction (q8gemv::reduce_store) are the same code: the bits equal the default launch's. The decoded
// Part of one row at a time is live (not R of them), so the registers drop and more CTAs fit per SM.
//
// Bulk copies need 16-byte aligned addresses and sizes: a chunk of a row starts at a whole number of blocks
// into a 16-byte aligned weight (kBlockBytes 144 / 176 are multiples of 16, static_assert below) and spans whole
// blocks. The PTX is sm_90+; on older devices launch_staged throws before launching.
#include "cuda/gguf_gemv_q8.cuh"

namespace candle_vllm::cuda::q8gemv {
namespace {

using gguf::XBlock;
constexpr int kDefaultStages = 2;

template <class Q>
constexpr int kChunkBlocks = kThreads / Q::kParts;  // super-blocks of one row per chunk

template <class Q>
constexpr int kChunkRowBytes = kChunkBlocks<Q> * Q::kBlockBytes;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)) : "memory");
}

// The elected thread's arrival, announcing `bytes` of bulk copies that complete this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
#endif

template <class Q, int R, int S>
__global__ void __launch_bounds__(kThreads)
    gemv_staged_kernel(void* __restrict__ y, bool bf16, const int8_t* __restrict__ xq, const XBlock* __restrict__ xb,
                       const uint8_t* __restrict__ w, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(Q::kBlockBytes % 16 == 0 && kChunkBlocks<Q> * Q::kParts == kThreads);
  extern __shared__ __align__(128) uint8_t stage[];  // [min(S, chunks)][R][kChunkRowBytes]
  __shared__ uint64_t bar[S];
  const int blocks = K / Q::kBlockElems, slots = blocks * Q::kParts;
  const int chunks = (blocks + kChunkBlocks<Q> - 1) / kChunkBlocks<Q>;
  const int row0 = blockIdx.x * R, rows_here = min(R, N - row0);
  const int64_t row_bytes = static_cast<int64_t>(blocks) * Q::kBlockBytes;
  auto buffer = [&](int c) { return stage + (c % S) * (R * kChunkRowBytes<Q>); };

  // Thread 0: chunk c of the CTA's rows into its stage buffer, one bulk copy per row.
  auto issue = [&](int c) {
    const auto bytes = static_cast<uint32_t>(min(kChunkBlocks<Q>, blocks - c * kChunkBlocks<Q>) * Q::kBlockBytes);
    uint64_t* b = &bar[c % S];
    mbar_arrive_expect_tx(b, bytes * rows_here);
    const uint8_t* src = w + row0 * row_bytes + static_cast<int64_t>(c) * kChunkRowBytes<Q>;
    for (int r = 0; r < rows_here; ++r) bulk_copy(buffer(c) + r * kChunkRowBytes<Q>, src + r * row_bytes, bytes, b);
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < S; ++i) mbar_init(&bar[i]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int c = 0; c < min(S, chunks); ++c) issue(c);
  }
  __syncthreads();  // the barriers are initialised before anyone waits on them
  pdl_wait();       // xq/xb come from the kernel before

  float acc[R][1];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = 0.f;
  const int p = threadIdx.x % Q::kParts;
  for (int c = 0; c < chunks; ++c) {
    mbar_wait(&bar[c % S], (c / S) & 1);  // the chunk's bytes have landed
    const int s = c * kThreads + threadIdx.x;
    if (s < slots) {
      const int b = s / Q::kParts;
      typename Q::X xv;
      Q::load_x(xv, xq + b * Q::kBlockElems, xb + b * (Q::kBlockElems / 32), p);
      const uint8_t* blk = buffer(c) + (threadIdx.x / Q::kParts) * Q::kBlockBytes;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint8_t* at = blk + min(r, rows_here - 1) * kChunkRowBytes<Q>;  // rows past N re-read the last
        typename Q::Raw raw;
        Q::template fetch<gguf::FromShared>(raw, at, p);
        Q part;
        part.decode(raw, at, p);
        acc[r][0] += part.dot(xv);
      }
    }
    if (c + S < chunks) {
      __syncthreads();  // every thread is done reading chunk c's buffer
      if (threadIdx.x == 0) {
        // Order those generic-proxy reads before the async-proxy writes that refill the buffer.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        issue(c + S);
      }
    }
  }

  pdl_launch_dependents();  // the next kernel's prologue overlaps the reduction
  reduce_store<R, 1>(acc, y, bf16, row0, N, 1);
#else
  __trap();  // launch_staged refuses devices before sm_90
#endif
}

template <class Q, int R, int S>
size_t smem_bytes(int K) {
  const int chunks = (K / Q::kBlockElems + kChunkBlocks<Q> - 1) / kChunkBlocks<Q>;
  return static_cast<size_t>(std::min(S, chunks)) * R * kChunkRowBytes<Q>;
}

// The kernel may take its largest buffer (over 48 KB needs opting in), set once per device.
template <class Q, int R, int S>
void allow_smem() {
  static std::atomic<int> done[kMaxDevices];
  per_device(done, "gguf_gemv_staged: shared memory", [](int) {
    check_cuda(cudaFuncSetAttribute(gemv_staged_kernel<Q, R, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(S * R * kChunkRowBytes<Q>)),
               "gguf_gemv_staged: shared memory");
    return 1;
  });
}

// CTAs per SM of the R-row, S-stage kernel for K (the buffers in use depend on K's chunk count: 1..S).
template <class Q, int R, int S>
int staged_ctas_per_sm(int K) {
  static std::atomic<int> cache[S][kMaxDevices];
  const int chunks = (K / Q::kBlockElems + kChunkBlocks<Q> - 1) / kChunkBlocks<Q>;
  allow_smem<Q, R, S>();
  return per_device(cache[std::min(S, chunks) - 1], "gguf_gemv_staged: residency",
                    [K](int) { return residency(gemv_staged_kernel<Q, R, S>, smem_bytes<Q, R, S>(K)); });
}

// Calls f(std::integral_constant<int, S>{}) for the stages choice S (2 or 4).
template <class F>
void with_stages(int stages, F&& f) {
  if (stages == 2) f(std::integral_constant<int, 2>{});
  else if (stages == 4) f(std::integral_constant<int, 4>{});
  else throw std::invalid_argument("gguf gemv staged: stages must be 0 (the default, 2), 2 or 4, got " +
                                   std::to_string(stages));
}

// The staged type's Q for qtype; throws for the others.
template <class F>
void with_staged_type(int qtype, F&& f) {
  if (qtype == gguf::Q4_K) f(gguf::Q8Dot<gguf::Q4_K>{});
  else if (qtype == gguf::Q5_K) f(gguf::Q8Dot<gguf::Q5_K>{});
  else throw std::invalid_argument("gguf gemv staged: only Q4_K and Q5_K weights have a staged kernel, got GGUF type " +
                                   std::to_string(qtype) + "; pass staged=false");
}

// Rows per CTA for rows = 0: by wave efficiency over the SMs with each R's residency (registers and buffers).
template <class Q, int S>
int staged_rows_for(int N, int K, int rows) {
  if (rows != 0) return rows;
  return rows_by_waves(N, {{2, staged_ctas_per_sm<Q, 2, S>(K)}, {4, staged_ctas_per_sm<Q, 4, S>(K)},
                           {8, staged_ctas_per_sm<Q, 8, S>(K)}});
}

template <class Q, int R, int S>
void launch(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int N, int K,
            cudaStream_t stream) {
  allow_smem<Q, R, S>();
  // A programmatic dependent of the kernel that wrote xq/xb: the first chunks stream while it runs.
  launch_pdl("gguf_gemv_staged", gemv_staged_kernel<Q, R, S>, dim3(static_cast<unsigned>((N + R - 1) / R)),
             dim3(kThreads), smem_bytes<Q, R, S>(K), stream, y, bf16, xq, xb, w, N, K);
}

void check_staged(int qtype, int K, int rows) {
  if (rows != 0 && rows != 2 && rows != 4 && rows != 8)
    throw std::invalid_argument("gguf gemv staged: rows must be 0 (the default rule), 2, 4 or 8, got " +
                                std::to_string(rows));
  with_staged_type(qtype, [&](auto tag) {
    using Q = decltype(tag);
    if (K % Q::kBlockElems != 0)
      throw std::invalid_argument("gguf gemv staged: K must be a whole number of 256-element blocks");
  });
}

}  // namespace

bool staged_type(int qtype) { return qtype == gguf::Q4_K || qtype == gguf::Q5_K; }

std::pair<int, int> staged_shape(int qtype, int N, int K, int rows, int stages) {
  check_staged(qtype, K, rows);
  const int s = stages == 0 ? kDefaultStages : stages;
  int r = 0;
  with_staged_type(qtype, [&](auto tag) {
    using Q = decltype(tag);
    with_stages(s, [&](auto st) { r = staged_rows_for<Q, decltype(st)::value>(N, K, rows); });
  });
  return {r, s};
}

void launch_staged(int qtype, void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int N, int K,
                   int rows, int stages, cudaStream_t stream) {
  static std::atomic<int> major[kMaxDevices];
  const int cc = per_device(major, "gguf_gemv_staged: compute capability", [](int dev) {
    int v = 0;
    check_cuda(cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev),
               "gguf_gemv_staged: compute capability");
    return v;
  });
  if (cc < 9)
    throw std::invalid_argument("gguf gemv staged: the bulk-copy kernel needs sm_90 or newer (this GPU is sm_" +
                                std::to_string(cc) + "x); pass staged=false");
  if (reinterpret_cast<std::uintptr_t>(w) % 16 != 0)
    throw std::invalid_argument("gguf gemv staged: the weight must be 16-byte aligned (bulk copies)");
  const std::pair<int, int> shape = staged_shape(qtype, N, K, rows, stages);
  const int r = shape.first;
  with_staged_type(qtype, [&](auto tag) {
    using Q = decltype(tag);
    with_stages(shape.second, [&](auto st) {
      constexpr int S = decltype(st)::value;
      if (r == 2) launch<Q, 2, S>(y, bf16, xq, xb, w, N, K, stream);
      else if (r == 4) launch<Q, 4, S>(y, bf16, xq, xb, w, N, K, stream);
      else launch<Q, 8, S>(y, bf16, xq, xb, w, N, K, stream);
    });
  });
}

}  // namespace candle_vllm::cuda::q8gemv
