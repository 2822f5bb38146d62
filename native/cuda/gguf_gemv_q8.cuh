// What the two dp4a GGUF GEMV kernels share: gguf_gemv_q8.cu reads the weights straight from global memory,
// gguf_gemv_staged.cu stages them through shared memory with the Hopper bulk copy. Both run kThreads threads per
// CTA, give thread t the slots t, t + kThreads, ... of every row and reduce through reduce_store, so they round
// identically; the launch rules size grids with the same wave-efficiency helpers.
#pragma once
#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <string>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/gguf_q8.cuh"

namespace candle_vllm::cuda::q8gemv {

constexpr int kThreads = 128;
constexpr int kMaxDevices = 64;

// ask(device) for the current device, asked once per device and cached (0: not asked yet).
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

inline int sm_count() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device(cache, "gguf_gemv_q8: SM count", [](int dev) {
    int n = 0;
    check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "gguf_gemv_q8: SM count");
    return n;
  });
}

// CTAs of `kernel` resident per SM (its registers under its launch bounds, and `smem` dynamic bytes).
template <typename... P>
int residency(void (*kernel)(P...), size_t smem) {
  int n = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem), "gguf_gemv_q8: residency");
  if (n < 1) throw std::runtime_error("gguf_gemv_q8: a kernel does not fit on an SM");
  return n;
}

// The share of the occupied CTA slots doing work when `ctas` CTAs run `slots` at a time: (ctas / slots) / waves.
inline double wave_efficiency(int64_t ctas, int64_t slots) {
  const int64_t waves = (ctas + slots - 1) / slots;
  return static_cast<double>(ctas) / static_cast<double>(slots * waves);
}

// Rows per CTA for N weight rows among `choices` (R, CTAs per SM of its kernel) by wave efficiency over the SMs'
// CTA slots: the largest R within 5 % of the best efficiency (more rows per CTA: more loads in flight per thread).
inline int rows_by_waves(int64_t n, std::initializer_list<std::pair<int, int>> choices) {
  const int64_t sms = sm_count();
  auto eff = [&](const std::pair<int, int>& c) { return wave_efficiency((n + c.first - 1) / c.first, sms * c.second); };
  double best = 0.0;
  for (const auto& c : choices) best = std::max(best, eff(c));
  int rows = 0;
  for (const auto& c : choices)
    if (1.05 * eff(c) >= best) rows = std::max(rows, c.first);
  return rows;
}

// The CTA's sums -> y: each thread's acc[r][m] is summed by warp shuffles, then lane 0's partials in warp order.
template <int R, int M>
__device__ __forceinline__ void reduce_store(const float (&acc)[R][M], void* y, bool bf16, int row0, int N,
                                             int rows_m) {
  __shared__ float red[kThreads / 32][R * M];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = warp_sum(acc[r][m]);
      if (lane == 0) red[warp][r * M + m] = v;
    }
  __syncthreads();
  if (threadIdx.x < R * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M, row = row0 + r;
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) v += red[i][threadIdx.x];
    if (row < N && m < rows_m) {
      const int64_t at = static_cast<int64_t>(m) * N + row;
      if (bf16) static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(v);
      else static_cast<__half*>(y)[at] = __float2half_rn(v);
    }
  }
}

// ---- the staged one-token GEMV (gguf_gemv_staged.cu) -------------------------------------------------------

// Whether the staged kernel decodes this type (Q4_K, Q5_K).
bool staged_type(int qtype);

// Rows per CTA and stages a staged launch uses for N x K (rows / stages 0: the defaults); throws on choices it
// does not compile.
std::pair<int, int> staged_shape(int qtype, int N, int K, int rows, int stages);

// y[1, N] = x @ W^T from the int8 codes xq/xb, the weight staged through shared memory; the same bits as the
// default launch. Needs sm_90 (throws before); a programmatic dependent of the kernel that wrote xq/xb.
void launch_staged(int qtype, void* y, bool bf16, const int8_t* xq, const gguf::XBlock* xb, const uint8_t* w, int N,
                   int K, int rows, int stages, cudaStream_t stream);

}  // namespace candle_vllm::cuda::q8gemv
