// GGUF quantized weights on the GPU: dequantize (whole tensors or gathered rows) and the fused decode GEMV
// (declared in plain C++ for the bindings; kernels in gguf_dequant.cu and gguf_gemv.cu).
#pragma once
#include <cstdint>

#include "bindings/tensor_arg.h"
#include "cuda/skinny_gemm.h"

namespace candle_vllm::cuda {

constexpr int kGgufGemvMaxM = 8;

// True for the block types the kernels decode (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, as gguf type codes).
bool gguf_supported(int qtype);

// out[r, :] (f32/f16/bf16 `dtype`, [rows, cols] contiguous) = the decoded row ids[r] (or r when ids is null) of
// the weight w (rows of `cols` elements in `qtype` blocks, contiguous, 16-byte aligned). f32 output equals gguf's
// dequantize exactly; f16/bf16 are that value rounded once.
void gguf_dequantize(void* out, const uint8_t* w, const int64_t* ids, int64_t rows, int64_t cols, int qtype,
                     DType dtype, std::uintptr_t stream);

// y[M, N] = x[M, K] @ W[N, K]^T for 1 <= M <= 8, x/y f16 or bf16 (contiguous, 4-byte aligned), W the
// quantized blocks (16-byte aligned). Each weight byte is read from memory once for all M rows.
void gguf_gemv(void* y, const void* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int qtype, DType dtype,
               std::uintptr_t stream);

// Bytes of scratch per 32 activations for gguf_gemv_q8's xb (an f32 scale and two int16 code sums).
constexpr int kGgufXBlockBytes = 8;

// True for the types gguf_gemv_q8 decodes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K).
bool gguf_gemv_q8_supported(int qtype);

// The same product with x first quantized to int8 per 32-element block (scale amax / 127, written to the
// caller's scratch: xq [M * K] int8, xb [M * K / 32] blocks of kGgufXBlockBytes), then dp4a dot products
// against the weight codes. K a multiple of 32; x, xq, w 16-byte aligned, xb 8-byte aligned; y f16/bf16 as x.
// rows picks the weight rows per CTA (2, 4 or 8 for one or two tokens, 2 or 4 from three up; 0: the default rule,
// gguf_gemv_q8_rows); every choice gives the same bits.
void gguf_gemv_q8(void* y, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M, int64_t N, int64_t K,
                  int qtype, DType dtype, std::uintptr_t stream, int rows = 0);

// gguf_gemv_q8 on activations already quantized by the kernel before (RMSNorm or SiLU-and-mul with codes, see
// native/cuda/q8_activation.cuh): no quantizer launch, the GEMV waits on that kernel directly. xq/xb as above;
// dtype is y's.
void gguf_gemv_q8_quantized(void* y, const int8_t* xq, const void* xb, const uint8_t* w, int64_t M, int64_t N,
                            int64_t K, int qtype, DType dtype, std::uintptr_t stream, int rows = 0);

// What the RoPE + cache epilogue needs besides the GEMV's operands: the same fields as the skinny GEMM's epilogue
// (positions, cos/sin table, the cache halves, slots, q_rows, rot_rows, head_dim, kv_heads), but the first rot_rows
// rows of W hold each q/k head's halves interleaved in pair group 1 (channel i, then half + i: ops/row_pairs.py),
// so a CTA's even number of consecutive rows holds whole rotation pairs.
using GgufRopeCache = SkinnyRopeCache;

// gguf_gemv_q8 (x non-null: quantized first into xq/xb) or gguf_gemv_q8_quantized (x null: xq/xb hold the codes;
// with tensor_cores, of gguf_mmq_x_group's scale group)
// whose epilogue rotates q and k (neox, cos/sin rounded to dtype as rotary_embedding does) and stores k and v at
// the tokens' cache slots (< 0: not stored): y [M, N] in the standard head layout and the cache are left exactly as
// the GEMV followed by rotary_embedding_cache (pair_group 1) would leave them. Any M <= 8; N = q_rows + 2 * kv_heads
// * head_dim, head_dim even; the same rows choice as the plain GEMV. tensor_cores: the product of gguf_mmq instead
// (M <= kGgufMmqMaxM, its argument rules, rows = 0), its store the same epilogue.
void gguf_gemv_q8_rope_cache(void* y, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M, int64_t N,
                             int64_t K, int qtype, DType dtype, const GgufRopeCache& rope, std::uintptr_t stream,
                             int rows = 0, bool tensor_cores = false);

constexpr int kGgufMmqMaxM = 32;

// gguf_mmq's kernels: the default rule (the staged kernel where it fits and no row tiles are asked for), the kernel
// that keeps its weights in flight in registers (gguf_mmq.cu), or the one that streams them through shared memory
// (gguf_mmq_staged.cu: up to 8 tokens on Hopper).
enum MmqStaging : int { kMmqStagingAuto = 0, kMmqStagingRegisters = 1, kMmqStagingShared = 2 };
constexpr int kGgufMmqStagedMaxM = 8;

// Whether gguf_mmq's staged kernel takes a call of M tokens of a qtype weight with K columns on the current device:
// a Hopper GPU running the module's sm_90a code (bulk copies and mbarriers), 1 <= M <= kGgufMmqStagedMaxM, and rows
// whose bytes are a multiple of 16 (a bulk copy's granule; e.g. Q3_K and Q6_K need K a multiple of 2048).
bool gguf_mmq_staged_fits(int qtype, int M, int K);

// True for the types gguf_mmq has a kernel for (those of gguf_gemv_q8: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K).
bool gguf_mmq_supported(int qtype);

// The scale group (values per activation scale, q8_activation.cuh) gguf_mmq takes for the type: 256 for the
// K-quants (Q2_K..Q6_K: a unit's sums stay integer), 32 for the others (those of gguf_gemv_q8).
int gguf_mmq_x_group(int qtype);

// The warps splitting K a default gguf_mmq launch of M tokens takes on an N x K weight of the type on the current
// device (the rules of gguf_mmq.cu: default_warps, and staged_warps where the staged kernel runs); throws
// std::invalid_argument for a type without a kernel, M outside 1..kGgufMmqMaxM or a non-positive N or K.
int gguf_mmq_warps(int qtype, int M, int N, int K);

// The int8 product of gguf_gemv_q8 for decode batches of up to 32 tokens on tensor cores (gguf_mmq.cu): each
// weight is decoded once for all tokens instead of once per token. x non-null: quantized first into xq/xb with
// gguf_mmq_x_group(qtype)'s scale group; null: xq/xb already hold codes of that group (the caller's duty: other
// codes give wrong results). Same argument rules as gguf_gemv_q8 with 1 <= M <= kGgufMmqMaxM, K a multiple of 256
// and xb 16-byte aligned. Each token's result does not depend on the other tokens of a batch of 1-8 or of 9-32 (for
// the types gguf_mmq_warps gives 16 warps at up to 8 tokens, a batch's size class sets the f32 summation order, as
// the dp4a GEMV's batches and the product's do for every type). For the 32-element types it differs from the dp4a
// GEMV's by f32 rounding only (the same integer dot products, scaled and summed in another order); the K-quants'
// activations are rounded per 256 values. row_tiles, warps and staging are launch choices for
// benchmarks (16-row tiles per CTA, 1 or 2; warps per CTA splitting K, 4, 8, or 16 with one row tile; 0: the default
// rules; staging: the kernel, MmqStaging; the staged kernel takes no row_tiles): row_tiles changes only the speed,
// warps also the f32 summation order; the staged kernel sums as the register kernel with the same warps does.
void gguf_mmq(void* y, const void* x, int8_t* xq, void* xb, const uint8_t* w, int64_t M, int64_t N, int64_t K,
              int qtype, DType dtype, std::uintptr_t stream, int row_tiles = 0, int warps = 0,
              int staging = kMmqStagingAuto);

// The rows per CTA gguf_gemv_q8 launches with for M tokens and an N x K weight on the current device (rows = 0
// resolved by the default rule: per type, for Q2_K by the weight's size, and for Q4_K/Q5_K at one token and every
// type at two 8 rows when one wave of 8-row CTAs covers N on the device's SMs, else 4; Q5_1's two-token rows longer
// than 8192 take 2).
int gguf_gemv_q8_rows(int qtype, int64_t M, int64_t N, int64_t K, int rows);

}  // namespace candle_vllm::cuda
