// How fast can one kernel stream a decode weight on the H200: bf16 (33-235 MB) or GGUF (5-60 MB)?
// (benches/probe_stream_floor.py builds and drives this; benches/RESULTS.md, 2026-12-03, session 22, and session 56.)
// Pure streaming, no math: (a) bulk copies into a shared-memory ring, G CTAs each a contiguous equal share (the
// stream-K layout a GEMM over all SMs would use); (b) plain 16-byte loads, many CTAs. PDL: the ring's first stages
// are requested before griddepcontrol.wait; the trigger after the main loop.
#include <cuda_runtime.h>
#include <cstdint>

#include "cuda/mbarrier.cuh"

using namespace candle_vllm::cuda;

__device__ __forceinline__ uint32_t saddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int kConsumers>
__global__ void __launch_bounds__(32 * (kConsumers + 1), 1)
    ring_stream(const uint8_t* __restrict__ w, int64_t bytes, int chunk, int stages, float* out, int pdl) {
#ifdef CANDLE_VLLM_MBARRIER
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ alignas(8) uint64_t full[16], empty[16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t per = ((bytes / gridDim.x) + 15) & ~int64_t{15};
  const int64_t b0 = per * blockIdx.x, b1 = min(bytes, b0 + per);
  const int chunks = b1 > b0 ? static_cast<int>((b1 - b0 + chunk - 1) / chunk) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(saddr(&full[s]), 1);
      mbar_init(saddr(&empty[s]), kConsumers);
    }
    mbar_fence_init();
  }
  __syncthreads();
  float acc = 0.f;
  if (warp == kConsumers) {
    if (lane == 0) {
      const int first = min(stages, chunks);
      auto issue = [&](int c) {
        const int64_t off = b0 + int64_t{c} * chunk;
        const uint32_t n = static_cast<uint32_t>(min(int64_t{chunk}, b1 - off));
        mbar_expect_tx(saddr(&full[c % stages]), n);
        bulk_copy(saddr(ring + (c % stages) * chunk), w + off, n, saddr(&full[c % stages]));
      };
      for (int c = 0; c < first; ++c) issue(c);
      if (pdl) asm volatile("griddepcontrol.wait;\n" ::: "memory");
      for (int c = first; c < chunks; ++c) {
        mbar_wait(saddr(&empty[c % stages]), (c / stages - 1) & 1);
        issue(c);
      }
    }
  } else {
    if (pdl) asm volatile("griddepcontrol.wait;\n" ::: "memory");
    for (int c = 0; c < chunks; ++c) {
      mbar_wait(saddr(&full[c % stages]), (c / stages) & 1);
      acc += reinterpret_cast<const float*>(ring + (c % stages) * chunk)[warp * 32 + lane];
      __syncwarp();
      if (lane == 0) mbar_arrive(saddr(&empty[c % stages]));
    }
  }
  if (pdl) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (acc == 12345.f) out[blockIdx.x] = acc;
#endif
}

// With pdl, as the decode GEMVs launch: the next grid may start at once (the trigger at entry), and each thread's
// first load is in flight before griddepcontrol.wait (a GEMV waits there for its activations). One load, not the
// unrolled four: on the 5-20 MB GGUF weights the bigger grids give a thread fewer than four.
__global__ void ld_stream(const uint4* __restrict__ w, int64_t n, float* out, int pdl) {
  if (pdl) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const uint4 first = i < n ? w[i] : uint4{};
  if (pdl) asm volatile("griddepcontrol.wait;\n" ::: "memory");
  uint32_t x = first.x;
  for (i += stride; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = w[i], b = w[i + stride], c = w[i + 2 * stride], d = w[i + 3 * stride];
    x ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n; i += stride) x ^= w[i].x;
  if (x == 0x12345678u) out[0] = 1.f;
}

// A launch's configuration, a programmatic dependent launch where pdl is set.
struct Launch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  Launch(int grid, int threads, size_t smem, cudaStream_t stream, int pdl) {
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
  }
  Launch(const Launch&) = delete;
};

extern "C" int probe_ring(const void* w, int64_t bytes, int grid, int chunk, int stages, int consumers, int pdl,
                          void* out, cudaStream_t stream) {
  static bool sized = false;
  if (!sized) {
    cudaFuncSetAttribute(ring_stream<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024);
    cudaFuncSetAttribute(ring_stream<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024);
    sized = true;
  }
  Launch l(grid, 32 * (consumers + 1), static_cast<size_t>(chunk) * stages, stream, pdl);
  const cudaLaunchConfig_t& cfg = l.cfg;
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  float* o = static_cast<float*>(out);
  cudaError_t e = consumers == 8 ? cudaLaunchKernelEx(&cfg, ring_stream<8>, wp, bytes, chunk, stages, o, pdl)
                                 : cudaLaunchKernelEx(&cfg, ring_stream<4>, wp, bytes, chunk, stages, o, pdl);
  return static_cast<int>(e);
}

extern "C" int probe_ld(const void* w, int64_t bytes, int grid, int threads, int pdl, void* out,
                        cudaStream_t stream) {
  Launch l(grid, threads, 0, stream, pdl);
  return static_cast<int>(cudaLaunchKernelEx(&l.cfg, ld_stream, static_cast<const uint4*>(w), bytes / 16,
                                             static_cast<float*>(out), pdl));
}
