// Shared device helpers for the CUDA kernels: dtype conversion, 16-byte vectors, warp/block reductions,
// launch checks and the dtype dispatch the launchers use. Kernels assume the Python wrappers
// (pyengine/ops/cuda.py) checked shapes, contiguity and alignment.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "bindings/tensor_arg.h"

namespace candle_vllm::cuda {

inline cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// Launches are asynchronous: this catches configuration errors (bad grid, too much shared memory) at once.
inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

constexpr int kMaxDevices = 64;

// ask(device) for the current device, asked once per device and cached (0: not asked yet): for launch rules that
// read device properties or occupancies on every call.
template <class F>
int per_device(std::atomic<int> (&cache)[kMaxDevices], const char* what, F&& ask) {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), what);
  if (dev >= kMaxDevices) throw std::runtime_error(std::string(what) + ": device index above 63");
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    v = ask(dev);
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Multiprocessors of the current device (the launch rules size grids to fill them).
inline int device_sm_count() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device(cache, "SM count", [](int dev) {
    int n = 0;
    check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "SM count");
    return n;
  });
}

// Programmatic dependent launch (Hopper): a kernel started by launch_pdl may begin while the kernel before it
// on the stream is still running, so its prologue (weight prefetch, index maths, its own launch latency) hides
// behind that kernel's tail. Contract for every kernel launched this way: call pdl_wait() before reading what an
// earlier kernel wrote and before writing what an earlier kernel may still read; every CTA calls it (an early
// return too), so a grid never completes before the grids it depends on. Data an earlier kernel wrote is read
// after the wait with ordinary loads (__ldca, __ldcg or plain), never the read-only path (__ldg, or
// const __restrict__ that the compiler may turn into it): that path assumes the data is constant for the
// kernel's whole lifetime, which starts before the writer ends. pdl_launch_dependents() lets the next kernel
// start before this one ends. Where it goes was measured on the H200: the GEMV/GEMM and attention kernels
// trigger after their main loop (triggering at entry there let the next grids sit on the SMs while waiting:
// batch-1 147 vs 198 tok/s), while the small single-pass kernels between them (RMSNorm, SiLU-and-mul, RoPE,
// cache writes, the split-KV reduce, the activation quantizer) trigger at entry, so the GEMM after them
// launches and prefetches its weights while they wait (bf16 batch-1 232.6 vs 227.0 tok/s, q4k 402.8 vs 383.6).
// The GGUF one-token GEMV is the exception: at entry for every type but Q8_0 (batch-1, two rounds each, after vs at
// entry: q2k 436.9 / 434.3 vs 463.2 / 459.9, q3k 376.1 / 375.0 vs 391.0 / 394.8, q4k 449.1 / 445.8 vs 457.7 /
// 459.8, q6k 318.0 / 317.9 vs 332.9 / 332.0, q4_0 +1.1 %, q5k +1.8 %; q8_0, which streams at 69-95 % of bandwidth,
// 341.0 / 341.3 vs 335.6 / 336.7), and Q6_K's two-token one (+0.6 %; gguf_gemv_q8_kernel.cuh). The other two-token
// GEMVs, the same at 8 tokens, or in the int8 tensor-core product, measured even or slower (q4_0 batch 2 -2.0 %, q4k
// batch 16 4,168 vs 3,918, q6k 2,796 vs 2,510); so did the staged product's copying warp triggering once it has issued
// its last copy (batch-4/8 decode within 1 %; its deep-ring kernels up to 43 % slower).
// Both are no-ops before sm_90 and for kernels launched the ordinary way.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// An A/B switch for benchmarks and debugging: on unless the environment variable `name` is "0".
inline bool env_switch_on(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::string(v) != "0";
}

// CANDLE_VLLM_PDL=0 launches every such kernel the ordinary way.
inline bool pdl_enabled() {
  static const bool enabled = env_switch_on("CANDLE_VLLM_PDL");
  return enabled;
}

// CANDLE_VLLM_PDL_LAUNCH_ORDER=0 keeps the programmatic port on edges from kernels that are not ours (PdlCapture).
inline bool launch_order_edges_enabled() {
  static const bool enabled = env_switch_on("CANDLE_VLLM_PDL_LAUNCH_ORDER");
  return enabled;
}

// Graph capture of launch_pdl's kernels. The kernels it captures are remembered per capture sequence; when the next
// one's only predecessor is a kernel that is not ours (cuBLASLt's GEMMs, torch's), that kernel never triggers its
// dependents, so the programmatic edge launch_pdl's attribute makes would fire only at its end and our grid would
// pay its launch after its drain. The edge then comes from its launch-completion port instead: our grid launches
// once the other is wholly resident and waits on the SMs (pdl_wait, which still waits for its end and its writes).
// So a kernel launched this way, and any our kernels it lets start early, run their pre-wait part while the other
// kernel still runs: pdl_wait's contract above is what keeps them correct. Only for kernels built for sm_90 or later
// (before it pdl_wait is a no-op). Measured on an H100 (RESULTS.md, session 47): bf16 batch-64 decode +1.1 % (the
// RoPE + cache kernel after qkv_proj's GEMM and the SiLU after gate_up's), batch 1 even.
class PdlCapture {
 public:
  enum class Edges { kNotCapturing, kProgrammatic, kLaunchOrder };

  // The edge the next node captured on `stream` will take. kLaunchOrder: it was set from the launch-completion port,
  // and `kernel` must be launched without the programmatic attribute, which would replace it (and, should the launch
  // fail, restore() puts the dependency back as it was).
  Edges prepare(cudaStream_t stream, const void* kernel) {
    const cudaGraphNode_t* deps = nullptr;
    const cudaGraphEdgeData* data = nullptr;
    size_t n = 0;
    if (!capturing(stream, &deps, &data, &n)) return Edges::kNotCapturing;
    if (n != 1 || ours_.count(deps[0]) != 0 ||
        (data != nullptr && data[0].type != cudaGraphDependencyTypeDefault))
      return Edges::kProgrammatic;
    cudaGraphNodeType type;
    cudaFuncAttributes attrs;
    if (cudaGraphNodeGetType(deps[0], &type) != cudaSuccess || type != cudaGraphNodeTypeKernel ||
        cudaFuncGetAttributes(&attrs, kernel) != cudaSuccess || attrs.binaryVersion < 90) {
      (void)cudaGetLastError();  // a failed query must not surface in the next launch's check
      return Edges::kProgrammatic;
    }
    saved_node_ = deps[0];
    saved_edge_ = data != nullptr ? data[0] : cudaGraphEdgeData{};
    cudaGraphEdgeData edge = {};
    edge.from_port = cudaGraphKernelNodePortLaunchCompletion;
    edge.type = cudaGraphDependencyTypeProgrammatic;
    check_cuda(set_dependency(stream, edge), "launch_pdl: capture dependencies");
    return Edges::kLaunchOrder;
  }

  // After a launch that failed following prepare()'s kLaunchOrder: the next node takes the original edge again.
  void restore(cudaStream_t stream) {
    if (set_dependency(stream, saved_edge_) != cudaSuccess) (void)cudaGetLastError();  // the launch's error goes first
  }

  // Called after a launch captured on `stream`: remembers its node as ours.
  void remember_launch(cudaStream_t stream) {
    const cudaGraphNode_t* deps = nullptr;
    const cudaGraphEdgeData* data = nullptr;
    size_t n = 0;
    if (capturing(stream, &deps, &data, &n) && n == 1) ours_.insert(deps[0]);
  }

 private:
  bool capturing(cudaStream_t stream, const cudaGraphNode_t** deps, const cudaGraphEdgeData** data, size_t* n) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t err = cudaStreamGetCaptureInfo(stream, &status, &id, nullptr, deps, data, n);
#else
    const cudaError_t err = cudaStreamGetCaptureInfo_v3(stream, &status, &id, nullptr, deps, data, n);
#endif
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    if (status != cudaStreamCaptureStatusActive) return false;
    if (id != capture_) {  // a new capture sequence: the nodes remembered belong to a finished graph
      capture_ = id;
      ours_.clear();
    }
    return true;
  }

  // The next captured node's only dependency: saved_node_, over `edge`.
  cudaError_t set_dependency(cudaStream_t stream, cudaGraphEdgeData edge) {
#if CUDART_VERSION >= 13000
    return cudaStreamUpdateCaptureDependencies(stream, &saved_node_, &edge, 1, cudaStreamSetCaptureDependencies);
#else
    return cudaStreamUpdateCaptureDependencies_v2(stream, &saved_node_, &edge, 1, cudaStreamSetCaptureDependencies);
#endif
  }

  unsigned long long capture_ = 0;
  std::unordered_set<cudaGraphNode_t> ours_;
  cudaGraphNode_t saved_node_ = nullptr;
  cudaGraphEdgeData saved_edge_ = {};
};

inline PdlCapture& pdl_capture() {
  thread_local PdlCapture capture;
  return capture;
}

// Launches `kernel` as a programmatic dependent of the previous work on `stream` (see pdl_wait and PdlCapture).
template <typename... Params, typename... Args>
inline void launch_pdl(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  using Edges = PdlCapture::Edges;
  const bool pdl = pdl_enabled();
  const Edges edges = pdl && launch_order_edges_enabled()
                          ? pdl_capture().prepare(stream, reinterpret_cast<const void*>(kernel))
                          : Edges::kNotCapturing;
  cfg.numAttrs = pdl && edges != Edges::kLaunchOrder ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
  if (err != cudaSuccess && edges == Edges::kLaunchOrder) pdl_capture().restore(stream);
  check_cuda(err, what);
  if (edges != Edges::kNotCapturing) pdl_capture().remember_launch(stream);
}

// True when every pointer allows 16-byte vector access.
template <typename... P>
inline bool aligned16(const P*... ptrs) {
  return ((reinterpret_cast<std::uintptr_t>(ptrs) % 16 == 0) && ...);
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Rounds through T, so f32 maths can reproduce a torch op that materialises an intermediate in T.
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_f32(from_f32<T>(v)); }

// SwiGLU's product for one feature, in f32 from the T-rounded gate and up values: shared by silu_and_mul and the
// skinny GEMM's fused epilogue so both round identically (both files are built with the same flags).
__device__ __forceinline__ float silu_mul(float gate, float up) { return gate / (1.f + __expf(-gate)) * up; }

// RoPE on one pair (x1, x2) with cos c and sin s: (x1 c - x2 s, x2 c + x1 s). The products and the fused
// add are spelled out so every kernel that rotates (rotary.cu, the skinny GEMM's RoPE epilogue) rounds alike,
// whatever contraction the compiler would pick for the plain expression.
__device__ __forceinline__ float2 rope_pair(float x1, float x2, float c, float s) {
  return make_float2(__fmaf_rn(x1, c, -__fmul_rn(x2, s)), __fmaf_rn(x2, c, __fmul_rn(x1, s)));
}

// N elements of T moved as one aligned access (16 bytes for 8 halves or 4 floats).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < warps ? partial[lane] : 0.f;
  return warp_sum(v);
}

// Calls f(T{}) with T the storage type of `dtype`; f32 only when kAllowF32 (else it is never instantiated).
template <bool kAllowF32, typename F>
void dispatch_float(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::F16: f(__half{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    case DType::F32:
      if constexpr (kAllowF32) {
        f(float{});
        return;
      }
      break;
    default: break;
  }
  throw std::invalid_argument(std::string(op) + (kAllowF32 ? ": dtype must be f32, f16 or bf16" : ": dtype must be f16 or bf16"));
}

}  // namespace candle_vllm::cuda
