// Host side of the dp4a GGUF decode GEMV (kernels and design: gguf_gemv_q8_kernel.cuh): argument checks, the
// launch choices (rows per CTA; the loop form: pipelined Q4_K, row-by-row Q2_K at one and two tokens and Q4_0/Q4_1's
// two-token 8-row launches)
// and the entry points declared in gguf.h.
#include <type_traits>

#include "cuda/gguf_gemv_q8_kernel.cuh"
#include "cuda/gguf_mmq.h"
#include "cuda/gguf_mmq_staged.h"

namespace candle_vllm::cuda {
namespace {

template <class Q, int M, int R, Loop LOOP>
void launch_loop(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int rows_m, int N, int K,
                 const GgufRopeCache* rope, cudaStream_t stream) {
  const int64_t row_bytes = gguf::row_bytes(type_of<Q>(), K);
  const dim3 grid(static_cast<unsigned>((N + R - 1) / R)), block(cta_threads<Q>());
  // A programmatic dependent of the kernel that wrote xq/xb: the first weights stream while it runs.
  if (rope != nullptr)
    launch_pdl("gguf_gemv_q8_rope_cache", gemv_q8_kernel<Q, M, R, true, LOOP>, grid, block, 0, stream, y, bf16, xq,
               xb, w, rows_m, N, K, row_bytes, *rope);
  else
    launch_pdl("gguf_gemv_q8", gemv_q8_kernel<Q, M, R, false, LOOP>, grid, block, 0, stream, y, bf16, xq, xb, w,
               rows_m, N, K, row_bytes, GgufRopeCache{});
}

// The loop form (gguf_gemv_q8_kernel.cuh) but Q4_K's pipelined one: Q2_K's one- and two-token launches and Q4_0/Q4_1's
// two-token 8-row ones go row by row; everything else decodes all rows of a slot at once.
template <class Q, int M, int R>
constexpr Loop base_loop() {
  constexpr int type = type_of<Q>();
  constexpr bool row_by_row =
      (M <= 2 && type == gguf::Q2_K) || (M == 2 && R == 8 && (type == gguf::Q4_0 || type == gguf::Q4_1));
  return row_by_row ? Loop::kRowByRow : Loop::kDecodeAll;
}

// Q4_K's one-token plain launches over rows longer than one pass are pipelined; the others take base_loop.
template <class Q, int M, int R>
void launch_gemv(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int rows_m, int N, int K,
                 const GgufRopeCache* rope, cudaStream_t stream) {
  if constexpr (M == 1 && type_of<Q>() == gguf::Q4_K) {
    if (rope == nullptr && K / Q::kBlockElems * Q::kParts > cta_threads<Q>()) {
      launch_loop<Q, M, R, Loop::kPipelined>(y, bf16, xq, xb, w, rows_m, N, K, rope, stream);
      return;
    }
  }
  launch_loop<Q, M, R, base_loop<Q, M, R>()>(y, bf16, xq, xb, w, rows_m, N, K, rope, stream);
}

// CTAs of the M-token R-row kernel resident per SM (its registers under its launch bounds). For Q4_K rows longer
// than one pass the pipelined form runs instead (237 registers at R = 8 against 208): on the H200 both fit 4 CTAs
// per SM at R = 8, so the rule below picks the same R for either; re-check that when either kernel changes.
template <class Q, int R, int M = 1>
int ctas_per_sm() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device(cache, "gguf_gemv_q8: residency", [](int) {
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, gemv_q8_kernel<Q, M, R, false, base_loop<Q, M, R>()>,
                                                             cta_threads<Q>(), 0),
               "gguf_gemv_q8: residency");
    return n;
  });
}

// Q4_K/Q5_K at one token, every type at two (rows_for; Q5_1's long rows aside): R = 8 when one wave of 8-row CTAs
// covers N (SMs x CTAs per SM at R = 8), else R = 4.
// Measured on the H200 (132 SMs, bench_quant_cuda.py --sweep-rows; 64-thread CTAs, R = 4: 120 / 123 registers,
// 8 CTAs per SM; R = 8: 208 / 217 registers, 4 per SM, 528 slots):
//   q4k: N 4096 (512 CTAs, one wave) -> 8: K 4096 4.96 vs 5.34 us, K 14336 12.71 vs 12.59 (even); N 6144 -> 4: 7.51
//     vs 7.51 (even); N 28672 -> 4: 20.61 vs 23.40 (the deeper occupancy streams the long grid better).
//   q5k: N 4096 -> 8: 5.79 vs 5.94, 15.23 vs 15.38; N 6144 -> 4: 8.65 vs 9.03; N 28672 -> 4: 27.04 vs 30.05.
template <class Q, int M = 1>
int rows_by_waves(int n) {
  return (n + 7) / 8 <= static_cast<int64_t>(device_sm_count()) * ctas_per_sm<Q, 8, M>() ? 8 : 4;
}

// The rows per CTA a one-token launch with rows = 0 uses. Measured on the H200 (bench_quant_cuda.py
// --sweep-rows, four Llama-3-8B shapes): the 32-element types take R = 4 (session 33, --codes, us summed over the
// four shapes, R = 2 / 4 / 8: q4_0 42.2 / 36.9 / 41.9, q4_1 42.8 / 38.6 / 39.2, q5_0 48.6 / 42.7 / 44.2, q5_1 48.8 /
// 44.0 / 45.6, q8_0 65.9 / 60.9 / 62.0; R = 8 won only q4_1's and q5_0's 4096x14336, by 1-5 %); Q6_K (64-thread
// CTAs of 64-weight parts) R = 4 best or within 1 % on all four (R = 2 -> 4: 11.03 -> 10.85, 7.66 -> 7.22, 36.38 ->
// 36.77, 21.91 -> 19.36 us); Q3_K: R = 4 best on all four (R = 4 / 8: 8.34 / 10.05, 5.81 / 6.43, 28.50 / 33.98,
// 16.28 / 17.74 us); Q2_K (the row-by-row loop, session 27): R = 8 on N 4096 / 6144 (4.15 / 6.08 us), R = 4 on the
// long grid and the long rows (28672x4096 18.55 against 19.76 us at R = 8, 4096x14336 11.05 against 11.34), taken
// here as R = 4 for weights of more than 2^25 elements.
template <class Q>
int default_rows_at_m1(int n, int k) {
  constexpr int type = type_of<Q>();
  if constexpr (type == gguf::Q4_K || type == gguf::Q5_K) return rows_by_waves<Q>(n);
  else if constexpr (type == gguf::Q2_K) return static_cast<int64_t>(n) * k > (int64_t{1} << 25) ? 4 : 8;
  else return 4;
}

// Rows per CTA for M tokens: the caller's choice, else the one-token rule; at two tokens the wave rule (8 where one
// wave of 8-row CTAs covers N, else 4; Q5_1 2 on rows longer than 8192); 4 from three up.
// Session 33's sweep (--sweep-rows --m 2 4 8 --codes, us summed over the four 8B shapes): at two tokens, R = 2 -> 8,
// q2k 71.4 -> 53.3, q3k 75.6 -> 55.1, q4k 67.9 -> 52.3, q5k 75.5 -> 63.1, q6k 80.6 -> 67.8. Per shape (session 38,
// H100, --sweep-rows --m 2 --codes), R = 4 beat 8 on the weights of more than one wave: 6144x4096 q2k 7.59 / 9.06,
// q3k 8.44 / 8.82, q4k 8.89 / 8.93, q5k 10.14 / 10.38, q6k 11.20 / 11.31; 28672x4096 q2k 25.16 / 26.70, q3k 28.08 /
// 31.47, q4k 28.53 / 29.97, q6k 35.78 / 39.71 (q5k 37.66 / 37.12), and batch-2 decode gained (q6k +2.4 %, q3k +3.8 %;
// q4k even). The 32-element types (R = 2 -> 4 under the several-token bound, gguf_gemv_q8_kernel.cuh, session 33):
// q4_0 54.9 -> 51.0, q4_1 58.6 -> 49.4, q5_0 56.7 -> 54.6, q5_1 57.6 -> 54.5, but q8_0 65.0 -> 66.0. Two H200 sweeps
// per shape (sessions 48 and 49) put Q5_0, Q5_1 and Q8_0 at R = 8 on N = 4096 (one wave) and Q8_0 at R = 4 on
// 6144x4096; the wave rule over the old one (Q8_0 2, the others 4), batch-2 decode on the H200 (session 49, two
// alternating pairs): q5_0 866.4 / 870.6 against 839.3 / 848.0 tok/s, q8_0 745.4 / 748.1 against 735.2 / 727.6,
// q5_1 855.0 / 858.7 against 841.3 / 827.8. Q4_0 and Q4_1 joined once their 8-row launch ran row by row
// (gguf_gemv_q8_kernel.cuh; H100, session 49, --sweep-rows --m 2, R = 4 / 8 us: 4096x4096 q4_0 6.01 / 5.53, q4_1
// 6.19 / 5.26; 6144x4096 8.06 / 8.58, 7.69 / 7.96; the rule misses q4_0's 28672x4096, 28.07 / 27.07, and 4096x14336,
// 13.56 / 13.91), batch-2 decode against R = 4: q4_0 778.0 / 774.7 against 777.4 / 767.0 tok/s, q4_1 778.5 / 778.4
// against 765.8 / 769.4. At four and eight tokens R = 4 beat R = 2 on every type by 6-60 %.
template <class Q>
int rows_for(int m, int n, int k, int rows) {
  if (rows != 0) return rows;
  if (m == 1) return default_rows_at_m1<Q>(n, k);
  if (m == 2) {
    constexpr int type = type_of<Q>();
    // Both H200 sweeps: Q5_1 on 4096x14336 fastest at R = 2 (13.34 against 14.40 us at R = 4; 13.02 against 14.17 at
    // 8); batch-2 decode against the wave rule there (H100, session 49): 709.6 / 710.5 against 700.8 / 701.8 tok/s.
    if (type == gguf::Q5_1 && k > 8192) return 2;
    return rows_by_waves<Q, 2>(n);
  }
  return 4;
}

void check_gemv_args(const char* what, int64_t M, int64_t N, int64_t K, const void* w, const void* xq,
                     const void* xb, DType dtype, int max_m = kGgufGemvMaxM) {
  const std::string op(what);
  if (M < 1 || M > max_m) throw std::invalid_argument(op + ": M must be in 1.." + std::to_string(max_m));
  if (N < 1 || K < 1 || N > INT32_MAX || K > INT32_MAX / 8) throw std::invalid_argument(op + ": bad N or K");
  if (K % 32 != 0) throw std::invalid_argument(op + ": K must be a multiple of 32");
  if (!aligned16(w, xq) || reinterpret_cast<std::uintptr_t>(xb) % 8 != 0)
    throw std::invalid_argument(op + ": w and xq must be 16-byte aligned, xb 8-byte aligned");
  if (dtype != DType::F16 && dtype != DType::BF16) throw std::invalid_argument(op + ": dtype must be f16 or bf16");
}

// The rows-per-CTA choices: 2, 4 or 8 for one or two tokens, 2 or 4 from three tokens up (8 rows of 4-8 tokens
// would hold 32-64 sums per thread).
void check_launch_choice(const char* what, int64_t M, int rows) {
  const bool eight = M <= 2;
  if (rows != 0 && rows != 2 && rows != 4 && !(eight && rows == 8))
    throw std::invalid_argument(std::string(what) + ": rows must be 0 (the default rule), 2, 4" +
                                (eight ? " or 8" : " (8 only for one or two tokens)") + ", got " +
                                std::to_string(rows) + " for M = " + std::to_string(M));
}

// x's int8 codes and blocks into xq/xb, one scale per group of 32 or 256 values (the kernel's own quantizer
// launch), after the argument checks.
void quantize_activations(const char* what, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M,
                          int64_t N, int64_t K, int qtype, DType dtype, int rows, cudaStream_t s,
                          int max_m = kGgufGemvMaxM, int group = 32) {
  check_gemv_args(what, M, N, K, w, xq, xb, dtype, max_m);
  check_launch_choice(what, M, rows);
  if (!aligned16(x)) throw std::invalid_argument(std::string(what) + ": x must be 16-byte aligned");
  if (!gguf_gemv_q8_supported(qtype))
    throw std::invalid_argument(std::string(what) + ": no int8-activation kernel for GGUF type " + std::to_string(qtype));
  if ((group != 32 && group != 256) || K % group != 0)
    throw std::invalid_argument(std::string(what) + ": the activations' scale group must be 32 or 256 values and "
                                "divide K");
  const int64_t vectors = M * K / 8;
  dispatch_float<false>(dtype, what, [&](auto t) {
    using T = decltype(t);
    const unsigned grid = static_cast<unsigned>((vectors + 255) / 256);
    dispatch_q8_group(group, [&](auto g) {
      launch_pdl("gguf_gemv_q8: quantize activations", quantize_x_kernel<T, g>, dim3(grid), dim3(256), 0, s,
                 static_cast<const T*>(x), xq, static_cast<XBlock*>(xb), vectors);
    });
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
    const int r = rows_for<Q>(m, n, k, rows);
    if (m <= 2) {
      auto by_rows = [&](auto tokens) {
        constexpr int kM = decltype(tokens)::value;
        if (r == 2) launch_gemv<Q, kM, 2>(y, bf16, xq, xb, w, m, n, k, rope, s);
        else if (r == 4) launch_gemv<Q, kM, 4>(y, bf16, xq, xb, w, m, n, k, rope, s);
        else launch_gemv<Q, kM, 8>(y, bf16, xq, xb, w, m, n, k, rope, s);
      };
      if (m == 1) by_rows(std::integral_constant<int, 1>{});
      else by_rows(std::integral_constant<int, 2>{});
    } else if (m <= 4) {
      if (r == 2) launch_gemv<Q, 4, 2>(y, bf16, xq, xb, w, m, n, k, rope, s);
      else launch_gemv<Q, 4, 4>(y, bf16, xq, xb, w, m, n, k, rope, s);
    } else {
      if (r == 2) launch_gemv<Q, 8, 2>(y, bf16, xq, xb, w, m, n, k, rope, s);
      else launch_gemv<Q, 8, 4>(y, bf16, xq, xb, w, m, n, k, rope, s);
    }
  });
  if (!known)
    throw std::invalid_argument(std::string(what) + ": no int8-activation kernel for GGUF type " + std::to_string(qtype));
  check_launch(what);
}

// The tensor-core product (plain store, or the RoPE + cache epilogue when rope is non-null), after its checks.
void run_mmq(const char* what, void* y, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M, int64_t N,
             int64_t K, int qtype, DType dtype, int row_tiles, int warps, int staging, const GgufRopeCache* rope,
             cudaStream_t s) {
  if (!gguf_mmq_supported(qtype))
    throw std::invalid_argument(std::string(what) + ": no tensor-core kernel for GGUF type " + std::to_string(qtype));
  // Every refusal before the quantizer launch: a refused call enqueues nothing.
  if (K % gguf::kUnitElems != 0) throw std::invalid_argument(std::string(what) + ": K must be a multiple of 256");
  if (reinterpret_cast<std::uintptr_t>(xb) % 16 != 0)
    throw std::invalid_argument(std::string(what) + ": xb must be 16-byte aligned (two XBlocks are read as one load)");
  if (row_tiles != 0 && row_tiles != 1 && row_tiles != 2)
    throw std::invalid_argument(std::string(what) + ": row_tiles must be 0 (the default rule), 1 or 2");
  if (warps != 0 && warps != 4 && warps != 8 && warps != 16)
    throw std::invalid_argument(std::string(what) + ": warps must be 0 (the default rule), 4, 8 or 16");
  if (warps == 16 && row_tiles == 2)
    throw std::invalid_argument(std::string(what) + ": 16 warps take one row tile (row_tiles 0 or 1)");
  if (staging != kMmqStagingAuto && staging != kMmqStagingRegisters && staging != kMmqStagingShared)
    throw std::invalid_argument(std::string(what) + ": staging must be 0 (the default rule), 1 (registers) or 2 "
                                "(shared memory)");
  if (staging == kMmqStagingShared) {
    if (M > kGgufMmqStagedMaxM || K > INT32_MAX ||
        !gguf_mmq_staged_fits(qtype, static_cast<int>(M), static_cast<int>(K)))
      throw std::invalid_argument(std::string(what) + ": the staged kernel takes 1..8 tokens on a Hopper GPU and rows "
                                  "a multiple of 16 bytes long; give staging 0 or 1");
    if (row_tiles != 0)
      throw std::invalid_argument(std::string(what) + ": row_tiles is the register kernel's launch choice (the staged "
                                  "kernel sizes its own tiles); give 0 with staging 2");
  }
  if (x != nullptr)
    quantize_activations(what, x, xq, xb, w, M, N, K, qtype, dtype, 0, s, kGgufMmqMaxM, gguf_mmq_x_group(qtype));
  else check_gemv_args(what, M, N, K, w, xq, xb, dtype, kGgufMmqMaxM);
  launch_gguf_mmq(y, dtype == DType::BF16, xq, static_cast<const XBlock*>(xb), w, static_cast<int>(M),
                  static_cast<int>(N), static_cast<int>(K), qtype, row_tiles, warps, staging, rope, s);
  check_launch(what);
}

}  // namespace

bool gguf_gemv_q8_supported(int qtype) {
  return gguf::dispatch_q8(qtype, [](auto) {});
}

int gguf_gemv_q8_rows(int qtype, int64_t M, int64_t N, int64_t K, int rows) {
  check_launch_choice("gguf_gemv_q8_rows", M, rows);
  if (N < 1 || N > INT32_MAX || K < 1 || K > INT32_MAX) throw std::invalid_argument("gguf_gemv_q8_rows: bad N or K");
  int out = 0;
  if (!gguf::dispatch_q8(qtype, [&](auto tag) {
        out = rows_for<decltype(tag)>(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), rows);
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
                             int rows, bool tensor_cores) {
  const char* what = "gguf_gemv_q8_rope_cache";
  check_rope(rope, N);
  const cudaStream_t s = as_stream(stream);
  if (tensor_cores) {
    if (rows != 0)
      throw std::invalid_argument(std::string(what) + ": rows is a dp4a launch choice; give 0 with tensor_cores");
    run_mmq(what, y, x, xq, xb, w, M, N, K, qtype, dtype, 0, 0, kMmqStagingAuto, &rope, s);
    return;
  }
  if (x != nullptr) quantize_activations(what, x, xq, xb, w, M, N, K, qtype, dtype, rows, s);
  else check_gemv_args(what, M, N, K, w, xq, xb, dtype);
  launch_q8(what, y, xq, static_cast<const XBlock*>(xb), w, M, N, K, qtype, dtype, rows, &rope, s);
}

void gguf_mmq(void* y, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M, int64_t N, int64_t K,
              int qtype, DType dtype, std::uintptr_t stream, int row_tiles, int warps, int staging) {
  run_mmq("gguf_mmq", y, x, xq, xb, w, M, N, K, qtype, dtype, row_tiles, warps, staging, nullptr, as_stream(stream));
}

}  // namespace candle_vllm::cuda
