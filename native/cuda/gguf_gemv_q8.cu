// Decode GEMV against int8 activations: y[M, N] = x[M, K] @ W[N, K]^T for M <= 8, W in GGUF blocks.
//
// gguf_gemv_q8 makes two launches on the caller's stream. The first quantizes each 32-element block of x to
// int8 codes (q8_activation.cuh: scale amax / 127, IEEE division, rounding half away from zero, as the CPU
// kernels do) plus per-half code sums. gguf_gemv_q8_quantized skips it: the kernel before it (RMSNorm or
// SiLU-and-mul) already wrote the codes. The GEMV itself streams W (a programmatic dependent launch: it fetches
// its first weights while the producer of the codes runs):
// a CTA (128 threads; 64 for Q4_K/Q5_K/Q6_K) owns R weight rows and its threads walk the rows' blocks together,
// each taking one Part of a block (gguf_q8.cuh) for all R rows at once, so several independent weight loads
// are in flight per thread and each activation load serves every row. Products are integer dp4a sums scaled
// per block in f32; threads reduce by warp shuffles and one shared-memory step. No shared-memory staging: the
// int8 activations (K bytes per token) stay in L1 and are shared by all CTAs of an SM. The kernel is bound by
// its integer instruction issue (decoding), not by loads in flight: a persistent variant that staged weights
// through shared memory with cp.async several tasks ahead ran 1.4-2x slower on the H200.
//
// One token (M = 1) takes R in {2, 4, 8} as a launch choice (rows = 0: default_rows_at_m1). Every choice gives
// the same bits: each output row is summed by the same threads over the same slots in the same order, and
// reduced the same way.
//
// The RoPE + cache epilogue (gguf_gemv_q8_rope_cache) is the same kernel with another store: the q/k rows of a
// fused q/k/v weight hold each head's halves interleaved in pairs (rows i and half + i of a head adjacent, pair
// group 1 of ops/row_pairs.py), so with R even a CTA owns whole rotation pairs, and warp 0 (which holds the
// R x M final sums, R * M <= 32) swaps partners with one shuffle, rotates them as the separate RoPE kernel would,
// writes y in the standard head layout and stores k and v at the tokens' cache slots (gguf_rope_epilogue.cuh).
#include <atomic>

#include "cuda/common.cuh"
#include "cuda/gguf.h"
#include "cuda/gguf_q8.cuh"
#include "cuda/gguf_rope_epilogue.cuh"

namespace candle_vllm::cuda {
namespace {

using gguf::XBlock;

template <int T>
constexpr int type_code(const gguf::Q8Dot<T>*) {
  return T;
}

template <class Q>
constexpr int type_of() {
  return type_code(static_cast<const Q*>(nullptr));
}

// Threads per CTA: 128, but 64 for Q4_K/Q5_K/Q6_K, whose parts are a quarter block (a 4096-element row is 64
// parts, one per thread).
template <class Q>
__host__ __device__ constexpr int cta_threads() {
  return Q::kParts == 4 ? 64 : 128;
}

// CTAs per SM the register allocation must allow (__launch_bounds__ min blocks) for one token, R = 2, 4, 8: the
// bounds every measured launch ran with (H200 sweep, bench_quant_cuda.py --sweep-rows). 8 for 2-row CTAs (at
// most 64 registers, no spills; q6k 4096x4096 29.7 -> 37.0 % of bandwidth, 4096x14336 38.8 -> 44.9 %); the
// 4-row CTAs of Q4_K/Q5_K spill at 64 registers and lost (q4k 28672x4096 24.8 -> 28.1 us), so they keep the
// compiler's choice (1: 80 / 84 registers, 6 / 5 CTAs per SM); the others aim at one wave for N = 4096 (4096 / R
// CTAs on 132 SMs), lowered until ptxas -v (sm_90a) reports no spills. Q4_K/Q5_K, whose parts became a whole pair
// of sub-blocks in 64-thread CTAs, keep the compiler's choice at R = 4 and 8 (120 / 208 registers) and allow 8 of
// those CTAs at R = 2; Q6_K, whose parts became half-quarters of 64 weights, keeps R = 2 at 64 registers and the
// compiler's choice at 4 and 8 (128 / 228: its former 5 and 3 spilled). The bounds count 128-thread CTAs (min_ctas
// scales them). Several tokens keep the compiler's choice.
struct OneTokenBounds {
  int r2, r4, r8;
};

constexpr OneTokenBounds one_token_bounds(int type) {
  switch (type) {
    case gguf::Q4_K:
    case gguf::Q5_K: return {4, 1, 1};
    case gguf::Q6_K: return {8, 1, 1};
    default: return {8, 8, 4};  // the 32-element types
  }
}

template <class Q, int M, int R>
constexpr int min_ctas() {
  if (M != 1) return 1;
  const OneTokenBounds b = one_token_bounds(type_of<Q>());
  return (R == 2 ? b.r2 : R == 4 ? b.r4 : b.r8) * 128 / cta_threads<Q>();
}

// Eight threads per 32-element block, four elements each.
template <typename T>
__global__ void __launch_bounds__(256) quantize_x_kernel(const T* x, int8_t* __restrict__ xq,
                                                        XBlock* __restrict__ xb, int64_t blocks) {
  // The GEMV may start now: it streams its first weights while this grid runs and waits before reading xq.
  pdl_launch_dependents();
  pdl_wait();  // x is the output of the kernel before (a programmatic dependent launch too)
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = i >> 3;
  const bool live = blk < blocks;
  Vec<T, 4> in;
  if (live) in = *reinterpret_cast<const Vec<T, 4>*>(x + 4 * i);
  q8_store_vec(in, live, xq, xb, 4 * i);
}

// PIPE (Q4_K, one token, rows longer than one pass of the CTA's threads): each pass fetches the next pass's
// weights before it decodes and multiplies its own, so a thread always has a pass of loads in flight (twice the
// raw registers; the compiler's register choice). Measured on the H200 (4096x14336, 8 rows per CTA): q4k 12.10 vs
// 12.38 us, batch-1 decode 451.4 / 452.6 vs 449.3 / 450.0 tok/s; the other types lost (q8_0 20.1 vs 19.2 us,
// q4_0 13.0 vs 11.3, q6k 27.8 vs 21.5: the extra registers cost them more occupancy than the overlap gives).
template <class Q, int M, int R, bool ROPE, bool PIPE = false>
__global__ void __launch_bounds__(cta_threads<Q>(), (PIPE ? 1 : min_ctas<Q, M, R>()))
    gemv_q8_kernel(void* __restrict__ y, bool bf16, const int8_t* __restrict__ xq, const XBlock* __restrict__ xb,
                   const uint8_t* __restrict__ w, int rows_m, int N, int K, int64_t row_bytes,
                   const GgufRopeCache rope) {
  using Raw = typename Q::Raw;
  constexpr int kThreads = cta_threads<Q>();
  const int row0 = blockIdx.x * R;
  const int slots = K / Q::kBlockElems * Q::kParts;
  const uint8_t* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = w + static_cast<int64_t>(min(row0 + r, N - 1)) * row_bytes;
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

  auto block = [&](int r, int s) { return wr[r] + static_cast<int64_t>(s / Q::kParts) * Q::kBlockBytes; };
  auto load_x = [&](typename Q::X& xv, int m, int s) {
    const int t = min(m, rows_m - 1);  // rows past M re-read the last one; their sums are dropped
    const int b = s / Q::kParts;
    Q::load_x(xv, xq + static_cast<int64_t>(t) * K + b * Q::kBlockElems,
              xb + static_cast<int64_t>(t) * (K / 32) + b * (Q::kBlockElems / 32), s % Q::kParts);
  };
  auto dot = [&](const Q (&part)[R], int s) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      typename Q::X xv;
      load_x(xv, m, s);
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][m] += part[r].dot(xv);
    }
  };
  // The first weights do not depend on the kernel before, which writes xq/xb (the quantizer, or the RMSNorm /
  // SiLU that wrote them as it produced x): fetch them, then wait for its grid. Load -> use -> load: the decoded
  // slot is what stays live across the loop (fewer registers than its words).
  Q part[R];
  auto load = [&](int s) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      Raw raw;
      Q::fetch(raw, block(r, s), s % Q::kParts);
      part[r].decode(raw, block(r, s), s % Q::kParts);
    }
  };
  if constexpr (PIPE) {
    Raw next[R];
    auto fetch = [&](int s) {
#pragma unroll
      for (int r = 0; r < R; ++r) Q::fetch(next[r], block(r, s), s % Q::kParts);
    };
    if (threadIdx.x < slots) fetch(threadIdx.x);
    pdl_wait();
    for (int s = threadIdx.x; s < slots; s += kThreads) {
      Raw cur[R];
#pragma unroll
      for (int r = 0; r < R; ++r) cur[r] = next[r];
      if (s + kThreads < slots) fetch(s + kThreads);
#pragma unroll
      for (int r = 0; r < R; ++r) part[r].decode(cur[r], block(r, s), s % Q::kParts);
      dot(part, s);
    }
  } else {
    if (threadIdx.x < slots) load(threadIdx.x);
    pdl_wait();
    for (int s = threadIdx.x; s < slots; s += kThreads) {
      if (s != threadIdx.x) load(s);
      dot(part, s);
    }
  }

  pdl_launch_dependents();  // the next kernel's prologue overlaps the reduction
  RopeLane in{-1, 0.f, 0.f};
  if constexpr (ROPE) {
    if (threadIdx.x < R * M)  // warp 0's epilogue lanes (rows and tokens past the end read the last ones)
      in = rope_lane(rope, min(row0 + static_cast<int>(threadIdx.x) / M, N - 1),
                     min(static_cast<int>(threadIdx.x) % M, rows_m - 1));
  }
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
  if constexpr (ROPE) {
    static_assert(R % 2 == 0 && R * M <= 32 && (M & (M - 1)) == 0, "warp 0 holds whole pairs of rows");
    if (warp != 0) return;
    float v = 0.f;
    if (lane < R * M)
#pragma unroll
      for (int i = 0; i < kThreads / 32; ++i) v += red[i][lane];
    const float pv = __shfl_xor_sync(0xffffffffu, v, M);  // lane (r ^ 1) * M + m: the partner row, same token
    const int r = lane / M, m = lane % M, row = row0 + r;
    if (lane < R * M && row < N && m < rows_m) {
      if (bf16) rope_cache_store<__nv_bfloat16>(y, v, pv, in, rope, row, m, N);
      else rope_cache_store<__half>(y, v, pv, in, rope, row, m, N);
    }
  } else if (threadIdx.x < R * M) {
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

template <class Q, int M, int R>
void launch_gemv(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int rows_m, int N, int K,
                 const GgufRopeCache* rope, cudaStream_t stream) {
  const int64_t row_bytes = static_cast<int64_t>(K / Q::kBlockElems) * Q::kBlockBytes;
  const dim3 grid(static_cast<unsigned>((N + R - 1) / R)), block(cta_threads<Q>());
  // A programmatic dependent of the kernel that wrote xq/xb: the first weights stream while it runs.
  if (rope != nullptr) {
    launch_pdl("gguf_gemv_q8_rope_cache", gemv_q8_kernel<Q, M, R, true>, grid, block, 0, stream, y, bf16,
               xq, xb, w, rows_m, N, K, row_bytes, *rope);
    return;
  }
  if constexpr (M == 1 && type_of<Q>() == gguf::Q4_K) {
    if (K / Q::kBlockElems * Q::kParts > cta_threads<Q>()) {
      launch_pdl("gguf_gemv_q8", gemv_q8_kernel<Q, 1, R, false, true>, grid, block, 0, stream, y, bf16, xq, xb, w,
                 rows_m, N, K, row_bytes, GgufRopeCache{});
      return;
    }
  }
  launch_pdl("gguf_gemv_q8", gemv_q8_kernel<Q, M, R, false>, grid, block, 0, stream, y, bf16, xq, xb, w, rows_m, N,
             K, row_bytes, GgufRopeCache{});
}

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

int sm_count() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device(cache, "gguf_gemv_q8: SM count", [](int dev) {
    int n = 0;
    check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "gguf_gemv_q8: SM count");
    return n;
  });
}

// CTAs of the one-token R-row kernel resident per SM (its registers under its launch bounds).
template <class Q, int R>
int ctas_per_sm() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device(cache, "gguf_gemv_q8: residency", [](int) {
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, gemv_q8_kernel<Q, 1, R, false>, cta_threads<Q>(), 0),
               "gguf_gemv_q8: residency");
    return n;
  });
}

// Q4_K/Q5_K at one token: R = 8 when one wave of 8-row CTAs covers N (SMs x CTAs per SM at R = 8), else R = 4.
// Measured on the H200 (132 SMs, bench_quant_cuda.py --sweep-rows; 64-thread CTAs, R = 4: 120 / 123 registers,
// 8 CTAs per SM; R = 8: 208 / 217 registers, 4 per SM, 528 slots):
//   q4k: N 4096 (512 CTAs, one wave) -> 8: K 4096 4.96 vs 5.34 us, K 14336 12.71 vs 12.59 (even); N 6144 -> 4: 7.51
//     vs 7.51 (even); N 28672 -> 4: 20.61 vs 23.40 (the deeper occupancy streams the long grid better).
//   q5k: N 4096 -> 8: 5.79 vs 5.94, 15.23 vs 15.38; N 6144 -> 4: 8.65 vs 9.03; N 28672 -> 4: 27.04 vs 30.05.
template <class Q>
int rows_by_waves(int n) {
  return (n + 7) / 8 <= static_cast<int64_t>(sm_count()) * ctas_per_sm<Q, 8>() ? 8 : 4;
}

// The rows per CTA a one-token launch with rows = 0 uses. Measured on the H200 (bench_quant_cuda.py
// --sweep-rows, four Llama-3-8B shapes): Q4_0 R = 4 beat R = 2 on all four (6.74 -> 6.37, 5.77 -> 4.70,
// 21.83 -> 19.56, 12.41 -> 11.37 us); Q6_K (64-thread CTAs of whole-pair parts) R = 4 best or within 1 % on all
// four (R = 2 -> 4: 11.03 -> 10.85, 7.66 -> 7.22, 36.38 -> 36.77, 21.91 -> 19.36 us); Q8_0 was best or within 2 %
// at R = 2. Q4_1, Q5_0, Q5_1 were not swept and keep R = 2.
template <class Q>
int default_rows_at_m1(int n) {
  constexpr int type = type_of<Q>();
  if constexpr (type == gguf::Q4_K || type == gguf::Q5_K) return rows_by_waves<Q>(n);
  else return type == gguf::Q4_0 || type == gguf::Q6_K ? 4 : 2;
}

// Rows per CTA for M tokens: the one-token choice (0: the default rule), 2 for two tokens, 4 from four tokens up
// (each activation load then serves 4 rows); measured sweeps in benches/RESULTS.md.
template <class Q>
int rows_for(int m, int n, int rows) {
  if (m == 1) return rows != 0 ? rows : default_rows_at_m1<Q>(n);
  return m == 2 ? 2 : 4;
}

void check_gemv_args(const char* what, int64_t M, int64_t N, int64_t K, const void* w, const void* xq,
                     const void* xb, DType dtype) {
  const std::string op(what);
  if (M < 1 || M > kGgufGemvMaxM) throw std::invalid_argument(op + ": M must be in 1..8");
  if (N < 1 || K < 1 || N > INT32_MAX || K > INT32_MAX / 8) throw std::invalid_argument(op + ": bad N or K");
  if (K % 32 != 0) throw std::invalid_argument(op + ": K must be a multiple of 32");
  if (!aligned16(w, xq) || reinterpret_cast<std::uintptr_t>(xb) % 8 != 0)
    throw std::invalid_argument(op + ": w and xq must be 16-byte aligned, xb 8-byte aligned");
  if (dtype != DType::F16 && dtype != DType::BF16) throw std::invalid_argument(op + ": dtype must be f16 or bf16");
}

void check_launch_choice(const char* what, int64_t M, int rows) {
  const std::string op(what);
  if (rows != 0 && rows != 2 && rows != 4 && rows != 8)
    throw std::invalid_argument(op + ": rows must be 0 (the default rule), 2, 4 or 8, got " + std::to_string(rows));
  if (M != 1 && rows != 0)
    throw std::invalid_argument(op + ": rows is a one-token choice (M = 1); pass rows=0 for M = " + std::to_string(M));
}

// x's int8 codes and blocks into xq/xb (the GEMV's own quantizer launch), after the argument checks.
void quantize_activations(const char* what, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M,
                          int64_t N, int64_t K, int qtype, DType dtype, int rows, cudaStream_t s) {
  check_gemv_args(what, M, N, K, w, xq, xb, dtype);
  check_launch_choice(what, M, rows);
  if (!aligned16(x)) throw std::invalid_argument(std::string(what) + ": x must be 16-byte aligned");
  if (!gguf_gemv_q8_supported(qtype))
    throw std::invalid_argument(std::string(what) + ": no int8-activation kernel for GGUF type " + std::to_string(qtype));
  const int64_t blocks = M * K / 32;
  dispatch_float<false>(dtype, what, [&](auto t) {
    using T = decltype(t);
    const unsigned grid = static_cast<unsigned>((blocks * 8 + 255) / 256);
    launch_pdl("gguf_gemv_q8: quantize activations", quantize_x_kernel<T>, dim3(grid), dim3(256), 0, s,
               static_cast<const T*>(x), xq, static_cast<XBlock*>(xb), blocks);
  });
}

void check_rope(const GgufRopeCache& rope, int64_t N) {
  const int64_t d = rope.head_dim;
  if (d < 2 || d % 2 != 0 || rope.q_rows % d != 0 || rope.rot_rows % d != 0 || rope.q_rows >= rope.rot_rows ||
      rope.rot_rows >= N || N - rope.rot_rows != rope.rot_rows - rope.q_rows ||
      (rope.rot_rows - rope.q_rows) / d != rope.kv_heads)
    throw std::invalid_argument(
        "gguf_gemv_q8_rope_cache: needs an even head_dim and N = q_rows + 2 * kv_heads * head_dim with whole heads");
  if (rope.positions == nullptr || rope.cos_sin == nullptr || rope.slots == nullptr || rope.key_cache == nullptr ||
      rope.value_cache == nullptr)
    throw std::invalid_argument("gguf_gemv_q8_rope_cache: positions, cos_sin, slots and both caches are required");
}

// The GEMV on the codes in xq/xb, a programmatic dependent of the kernel before (which wrote them).
void launch_q8(const char* what, void* y, const int8_t* xq, const XBlock* xb, const uint8_t* w, int64_t M, int64_t N,
               int64_t K, int qtype, DType dtype, int rows, const GgufRopeCache* rope, cudaStream_t s) {
  check_launch_choice(what, M, rows);
  const bool bf16 = dtype == DType::BF16;
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  const bool known = gguf::dispatch_q8(qtype, [&](auto tag) {
    using Q = decltype(tag);
    if (K % Q::kBlockElems != 0) throw std::invalid_argument(std::string(what) + ": K must be a whole number of blocks");
    if (m == 1) {
      switch (rows_for<Q>(m, n, rows)) {
        case 2: launch_gemv<Q, 1, 2>(y, bf16, xq, xb, w, 1, n, k, rope, s); break;
        case 4: launch_gemv<Q, 1, 4>(y, bf16, xq, xb, w, 1, n, k, rope, s); break;
        default: launch_gemv<Q, 1, 8>(y, bf16, xq, xb, w, 1, n, k, rope, s); break;
      }
    } else if (m == 2) {
      launch_gemv<Q, 2, 2>(y, bf16, xq, xb, w, m, n, k, rope, s);
    } else if (m <= 4) {
      launch_gemv<Q, 4, 4>(y, bf16, xq, xb, w, m, n, k, rope, s);
    } else {
      launch_gemv<Q, 8, 4>(y, bf16, xq, xb, w, m, n, k, rope, s);
    }
  });
  if (!known)
    throw std::invalid_argument(std::string(what) + ": no int8-activation kernel for GGUF type " + std::to_string(qtype));
  check_launch(what);
}

}  // namespace

bool gguf_gemv_q8_supported(int qtype) {
  return gguf::dispatch_q8(qtype, [](auto) {});
}

int gguf_gemv_q8_rows(int qtype, int64_t M, int64_t N, int rows) {
  check_launch_choice("gguf_gemv_q8_rows", M, rows);
  if (N < 1 || N > INT32_MAX) throw std::invalid_argument("gguf_gemv_q8_rows: bad N");
  int out = 0;
  if (!gguf::dispatch_q8(qtype, [&](auto tag) {
        out = rows_for<decltype(tag)>(static_cast<int>(M), static_cast<int>(N), rows);
      }))
    throw std::invalid_argument("gguf_gemv_q8_rows: no int8-activation kernel for GGUF type " + std::to_string(qtype));
  return out;
}

void gguf_gemv_q8(void* y, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M, int64_t N, int64_t K,
                  int qtype, DType dtype, std::uintptr_t stream, int rows) {
  const cudaStream_t s = as_stream(stream);
  quantize_activations("gguf_gemv_q8", x, xq, xb, w, M, N, K, qtype, dtype, rows, s);
  launch_q8("gguf_gemv_q8", y, xq, static_cast<const XBlock*>(xb), w, M, N, K, qtype, dtype, rows, nullptr, s);
}

void gguf_gemv_q8_quantized(void* y, const int8_t* xq, const void* xb, const uint8_t* w, int64_t M, int64_t N,
                            int64_t K, int qtype, DType dtype, std::uintptr_t stream, int rows) {
  check_gemv_args("gguf_gemv_q8_quantized", M, N, K, w, xq, xb, dtype);
  launch_q8("gguf_gemv_q8_quantized", y, xq, static_cast<const XBlock*>(xb), w, M, N, K, qtype, dtype, rows, nullptr,
            as_stream(stream));
}

void gguf_gemv_q8_rope_cache(void* y, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M, int64_t N,
                             int64_t K, int qtype, DType dtype, const GgufRopeCache& rope, std::uintptr_t stream,
                             int rows) {
  const char* what = "gguf_gemv_q8_rope_cache";
  check_rope(rope, N);
  const cudaStream_t s = as_stream(stream);
  if (x != nullptr) quantize_activations(what, x, xq, xb, w, M, N, K, qtype, dtype, rows, s);
  else check_gemv_args(what, M, N, K, w, xq, xb, dtype);
  launch_q8(what, y, xq, static_cast<const XBlock*>(xb), w, M, N, K, qtype, dtype, rows, &rope, s);
}

}  // namespace candle_vllm::cuda
