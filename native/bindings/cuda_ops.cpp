// Bindings for the CUDA kernels (pyengine/ops/cuda.py wraps them with the shape/dtype/alignment checks).
// Every function takes device pointers as integers and the caller's stream handle, and only enqueues work,
// so the calls are cheap and CUDA-graph capturable.
#ifdef CANDLE_VLLM_WITH_CUDA
#include <cmath>

#include "bindings/registry.h"
#include "bindings/tensor_arg.h"
#include "cuda/activation.h"
#include "cuda/argmax.h"
#include "cuda/norm.h"
#include "cuda/paged_attention.h"
#include "cuda/rotary.h"
#include "cuda/skinny_gemm.h"
#include "cuda/skinny_gemm_kn.h"
#include "cuda/turbo_decode_tc.h"
#include "cuda/turbo_kv.h"
#include "cuda/wide_gemm.h"

namespace py = pybind11;
using namespace candle_vllm;
using std::uintptr_t;

static Registrar registrar([](py::module_& m) {
  m.def(
      "cuda_skinny_gemm",
      [](uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t partials, uintptr_t counters, int64_t M, int64_t N,
         int64_t K, int splits, int warps, bool silu_mul, int dtype, uintptr_t stream) {
        cuda::skinny_gemm(as_ptr<void>(y), as_ptr<const void>(x), as_ptr<const void>(w), as_ptr<float>(partials),
                          as_ptr<int>(counters), M, N, K, splits, warps, silu_mul, to_dtype(dtype), stream);
      },
      "y[M,N] = x[M,K] @ W[N,K]^T for M <= 16 (decode), optional serial split-K, 4 or 8 warps per CTA; with "
      "silu_mul W is an 8-row-interleaved gate/up projection and y[M,N/2] = silu(gate) * up");
  m.def(
      "cuda_skinny_gemm_rope_cache",
      [](uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t partials, uintptr_t counters, int64_t M, int64_t N,
         int64_t K, int splits, int warps, uintptr_t positions, uintptr_t cos_sin, uintptr_t key_cache,
         uintptr_t value_cache, uintptr_t slots, int q_rows, int rot_rows, int head_dim, int kv_heads,
         bool cache_e4m3, int dtype, uintptr_t stream) {
        const cuda::SkinnyRopeCache rope{as_ptr<const int64_t>(positions), as_ptr<const float>(cos_sin),
                                         as_ptr<void>(key_cache), as_ptr<void>(value_cache),
                                         as_ptr<const int64_t>(slots), q_rows, rot_rows, head_dim, kv_heads,
                                         cache_e4m3};
        cuda::skinny_gemm_rope_cache(as_ptr<void>(y), as_ptr<const void>(x), as_ptr<const void>(w),
                                     as_ptr<float>(partials), as_ptr<int>(counters), M, N, K, splits, warps, rope,
                                     to_dtype(dtype), stream);
      },
      "cuda_skinny_gemm of a fused qkv weight whose q/k heads have their halves interleaved in groups of 8, with "
      "neox RoPE on q/k and the k/v cache store (of x's dtype, or e4m3 with cache_e4m3) in the epilogue (y in the "
      "standard head layout)");
  m.def(
      "cuda_skinny_gemm_kn",
      [](uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t partials, uintptr_t counters, int64_t M, int64_t N,
         int64_t K, int splits, int warps, int stage_slabs, bool silu_mul, int dtype, uintptr_t stream) {
        cuda::skinny_gemm_kn(as_ptr<void>(y), as_ptr<const void>(x), as_ptr<const void>(w), as_ptr<float>(partials),
                             as_ptr<int>(counters), M, N, K, splits, warps, stage_slabs, silu_mul, to_dtype(dtype),
                             stream);
      },
      "y[M,N] = x[M,K] @ W[K,N] for M <= 16 (decode) over a weight stored [K, N], optional serial split-K; with "
      "silu_mul W's columns are gate/up interleaved in groups of 8 and y[M,N/2] = silu(gate) * up");
  m.def(
      "cuda_skinny_gemm_kn_ctas_per_sm",
      [](int64_t M, int warps, int stage_slabs, bool silu_mul, int dtype) {
        return cuda::skinny_gemm_kn_ctas_per_sm(M, warps, stage_slabs, silu_mul, to_dtype(dtype));
      },
      "CTAs of a cuda_skinny_gemm_kn launch (M, warps, stage_slabs, silu_mul, dtype) one SM holds at once");
  m.def(
      "cuda_wide_gemm",
      [](uintptr_t y, uintptr_t x, uintptr_t w, int64_t M, int64_t N, int64_t K, bool silu_mul, int dtype,
         uintptr_t stream) {
        cuda::wide_gemm(as_ptr<void>(y), as_ptr<const void>(x), as_ptr<const void>(w), M, N, K, silu_mul,
                        to_dtype(dtype), stream);
      },
      "y[M,N] = x[M,K] @ W[N,K]^T for M <= 64 on TMA + wgmma (Hopper, sm_90a build), 256 weight rows per CTA; "
      "with silu_mul W is an 8-row-interleaved gate/up projection and y[M,N/2] = silu(gate) * up");
  m.def("cuda_wide_gemm_available", &cuda::wide_gemm_available,
        "whether this device runs cuda_wide_gemm (a Hopper GPU, module built for sm_90a)");
  m.attr("cuda_wide_max_m") = cuda::kWideMaxM;
  m.attr("cuda_skinny_max_m") = cuda::kSkinnyMaxM;
  m.attr("cuda_skinny_chunk_k") = cuda::kSkinnyChunkK;
  m.attr("cuda_skinny_kn_max_m") = cuda::kSkinnyKnMaxM;
  m.def(
      "cuda_rms_norm",
      [](uintptr_t out, uintptr_t x, uintptr_t w, int64_t rows, int64_t hidden, float eps, int dtype, uintptr_t stream) {
        cuda::rms_norm(as_ptr<void>(out), as_ptr<const void>(x), as_ptr<const void>(w), rows, hidden, eps,
                       to_dtype(dtype), stream);
      },
      "out = x / rms(x) * weight over contiguous rows");
  m.def(
      "cuda_fused_add_rms_norm",
      [](uintptr_t x, uintptr_t residual, uintptr_t w, int64_t rows, int64_t hidden, float eps, int dtype,
         uintptr_t stream) {
        cuda::fused_add_rms_norm(as_ptr<void>(x), as_ptr<void>(residual), as_ptr<const void>(w), rows, hidden, eps,
                                 to_dtype(dtype), stream);
      },
      "in place: residual += x; x = rms_norm(residual) * weight");
  m.def(
      "cuda_rms_norm_q8",
      [](uintptr_t out, uintptr_t xq, uintptr_t xb, int group, uintptr_t x, uintptr_t w, int64_t rows, int64_t hidden,
         float eps, int dtype, uintptr_t stream) {
        cuda::rms_norm_q8(as_ptr<void>(out), as_ptr<int8_t>(xq), as_ptr<void>(xb), group, as_ptr<const void>(x),
                          as_ptr<const void>(w), rows, hidden, eps, to_dtype(dtype), stream);
      },
      "cuda_rms_norm that also writes out's int8 codes (xq) and blocks (xb), one scale per group (32 or 256) values, "
      "for the GGUF int8 kernels");
  m.def(
      "cuda_fused_add_rms_norm_q8",
      [](uintptr_t x, uintptr_t residual, uintptr_t xq, uintptr_t xb, int group, uintptr_t w, int64_t rows,
         int64_t hidden, float eps, int dtype, uintptr_t stream) {
        cuda::fused_add_rms_norm_q8(as_ptr<void>(x), as_ptr<void>(residual), as_ptr<int8_t>(xq), as_ptr<void>(xb),
                                    group, as_ptr<const void>(w), rows, hidden, eps, to_dtype(dtype), stream);
      },
      "cuda_fused_add_rms_norm that also writes the normed x's int8 codes (xq) and blocks (xb), one scale per group "
      "(32 or 256) values, for the GGUF int8 kernels");
  m.def(
      "cuda_silu_and_mul_q8",
      [](uintptr_t out, uintptr_t xq, uintptr_t xb, int group, uintptr_t x, int64_t tokens, int64_t d, int dtype,
         uintptr_t stream) {
        cuda::silu_and_mul_q8(as_ptr<void>(out), as_ptr<int8_t>(xq), as_ptr<void>(xb), group, as_ptr<const void>(x),
                              tokens, d, to_dtype(dtype), stream);
      },
      "cuda_silu_and_mul that also writes out's int8 codes (xq) and blocks (xb), one scale per group (32 or 256) "
      "values, for the GGUF int8 kernels");
  m.def(
      "cuda_silu_and_mul",
      [](uintptr_t out, uintptr_t x, int64_t tokens, int64_t d, int dtype, uintptr_t stream) {
        cuda::silu_and_mul(as_ptr<void>(out), as_ptr<const void>(x), tokens, d, to_dtype(dtype), stream);
      },
      "out = silu(x[:, :d]) * x[:, d:]");
  m.def(
      "cuda_silu_and_mul_interleaved",
      [](uintptr_t out, uintptr_t x, int64_t tokens, int64_t d, int dtype, uintptr_t stream, uintptr_t norm_rows,
         int64_t norm_stride, int64_t hidden, float eps) {
        cuda::silu_and_mul_interleaved(as_ptr<void>(out), as_ptr<const void>(x), tokens, d, to_dtype(dtype), stream,
                                       {as_ptr<const void>(norm_rows), norm_stride, hidden, eps});
      },
      "cuda_silu_and_mul over gate/up features interleaved in groups of 8; norm_rows (0: none) [tokens, hidden] "
      "with token stride norm_stride: gate and up are first scaled by each token's 1/rms of its row (eps)");
  m.def(
      "cuda_rotary_embedding",
      [](uintptr_t q, uintptr_t k, uintptr_t positions, uintptr_t cos_sin, int64_t tokens, int64_t q_heads,
         int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride, int64_t k_stride, int style,
         int pair_group, int dtype, uintptr_t stream) {
        cuda::rotary_embedding(as_ptr<void>(q), as_ptr<void>(k), as_ptr<const int64_t>(positions),
                               as_ptr<const float>(cos_sin), tokens, q_heads, k_heads, head_dim, rotary_dim, q_stride,
                               k_stride, style, pair_group, to_dtype(dtype), stream);
      },
      "RoPE in place on q and k (style: 0 gptj, 1 neox; pair_group 1 or 8: neox heads stored with their halves "
      "interleaved in groups of that many channels, left in the standard layout)");
  m.def(
      "cuda_rotary_embedding_cache",
      [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t positions, uintptr_t cos_sin, uintptr_t key_cache,
         uintptr_t value_cache, uintptr_t slots, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
         int64_t q_stride, int64_t k_stride, int64_t v_stride, int style, int pair_group, int dtype,
         int cache_dtype, uintptr_t stream, uintptr_t norm_rows, int64_t norm_stride, int64_t hidden, float eps) {
        cuda::rotary_embedding_cache(as_ptr<void>(q), as_ptr<void>(k), as_ptr<void>(v),
                                     as_ptr<const int64_t>(positions), as_ptr<const float>(cos_sin),
                                     as_ptr<void>(key_cache), as_ptr<void>(value_cache), as_ptr<const int64_t>(slots),
                                     tokens, q_heads, k_heads, head_dim, q_stride, k_stride, v_stride, style,
                                     pair_group, to_dtype(dtype), to_dtype(cache_dtype), stream,
                                     {as_ptr<const void>(norm_rows), norm_stride, hidden, eps});
      },
      "RoPE in place on q and k (whole heads), rotated k and v stored into the paged cache (q's dtype or e4m3) at "
      "their slots; "
      "norm_rows (0: none) [tokens, hidden] with token stride norm_stride: q, k and v are first scaled by each "
      "token's 1/rms of its row (eps), v in place too");
  m.def(
      "cuda_paged_attention_decode",
      [](uintptr_t out, uintptr_t q, uintptr_t key_cache, uintptr_t value_cache, uintptr_t block_tables,
         uintptr_t seq_lens, uintptr_t partial_out, uintptr_t partial_ml, uintptr_t reduce_counters, int64_t num_seqs,
         int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t q_stride, int64_t block_size,
         int64_t max_blocks, int64_t partition_size, int64_t num_partitions, int64_t heads_per_cta, int64_t splits,
         float scale, float softcap, int64_t sliding_window, int dtype, int cache_dtype, uintptr_t stream) {
        cuda::paged_attention_decode(as_ptr<void>(out), as_ptr<const void>(q), as_ptr<const void>(key_cache),
                                     as_ptr<const void>(value_cache), as_ptr<const int32_t>(block_tables),
                                     as_ptr<const int32_t>(seq_lens), as_ptr<float>(partial_out),
                                     as_ptr<float>(partial_ml), as_ptr<int32_t>(reduce_counters), num_seqs, q_heads,
                                     kv_heads, head_dim, q_stride, block_size, max_blocks, partition_size,
                                     num_partitions, heads_per_cta, splits, scale, softcap, sliding_window,
                                     to_dtype(dtype), to_dtype(cache_dtype), stream);
      },
      "one-token-per-sequence attention over a paged KV cache of q's dtype or e4m3 (split-KV when num_partitions > 1; reduce_counters "
      "0: a second reduce kernel, else the last CTA of each head group reduces)");
  m.attr("cuda_attn_cta_row") = cuda::kAttnCtaRow;
  m.def(
      "cuda_reshape_and_cache",
      [](uintptr_t k, uintptr_t v, uintptr_t key_cache, uintptr_t value_cache, uintptr_t slots, int64_t tokens,
         int64_t kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride, int dtype, int cache_dtype,
         uintptr_t stream) {
        cuda::reshape_and_cache(as_ptr<const void>(k), as_ptr<const void>(v), as_ptr<void>(key_cache),
                                as_ptr<void>(value_cache), as_ptr<const int64_t>(slots), tokens, kv_heads, head_dim,
                                k_stride, v_stride, to_dtype(dtype), to_dtype(cache_dtype), stream);
      },
      "write new K/V rows into the paged cache at their flat slots (negative slots skipped)");
  m.def(
      "cuda_round_to_e4m3",
      [](uintptr_t k, uintptr_t v, int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t k_stride,
         int64_t v_stride, int dtype, uintptr_t stream) {
        cuda::round_to_e4m3(as_ptr<void>(k), as_ptr<void>(v), tokens, kv_heads, head_dim, k_stride, v_stride,
                            to_dtype(dtype), stream);
      },
      "round K/V rows in place to the values an e4m3 cache holds of them");
  m.def(
      "cuda_turbo_cache_write",
      [](uintptr_t k, uintptr_t v, uintptr_t cache, uintptr_t slots, uintptr_t signs, int64_t tokens,
         int64_t kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride, int k_bits, bool round_trip,
         int dtype, uintptr_t stream) {
        cuda::turbo_cache_write(as_ptr<const void>(k), as_ptr<const void>(v), as_ptr<void>(cache),
                                as_ptr<const int64_t>(slots), as_ptr<const float>(signs), tokens, kv_heads, head_dim,
                                k_stride, v_stride, k_bits, round_trip, to_dtype(dtype), stream);
      },
      "write new K/V as TurboQuant rows at their flat slots (negative slots skipped); round_trip: then overwrite "
      "k/v with the values the rows decode to");
  m.def(
      "cuda_turbo_decode_attention",
      [](uintptr_t out, uintptr_t q, int64_t q_stride, uintptr_t cache, uintptr_t block_tables, uintptr_t seq_lens,
         uintptr_t signs, uintptr_t partials, int64_t num_seqs, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
         int64_t block_size, int64_t max_blocks, int64_t parts, int64_t piece_unit, float scale,
         int64_t sliding_window, float softcap, int k_bits, bool tensor_cores, int dtype, uintptr_t stream) {
        cuda::turbo_decode_attention(as_ptr<void>(out), as_ptr<const void>(q), q_stride, as_ptr<const void>(cache),
                                     as_ptr<const int32_t>(block_tables), as_ptr<const int32_t>(seq_lens),
                                     as_ptr<const float>(signs), as_ptr<float>(partials), num_seqs, q_heads, kv_heads,
                                     head_dim, block_size, max_blocks, parts, piece_unit, scale, sliding_window,
                                     softcap, k_bits, tensor_cores, to_dtype(dtype), stream);
      },
      "paged decode attention over TurboQuant rows, one new query per sequence");
  m.def(
      "cuda_turbo_rope_cache_write",
      [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t positions, uintptr_t cos_sin, uintptr_t cache,
         uintptr_t slots, uintptr_t signs, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
         int64_t q_stride, int64_t k_stride, int64_t v_stride, int style, int pair_group, int k_bits, int dtype,
         uintptr_t stream, uintptr_t norm_rows, int64_t norm_stride, int64_t hidden, float eps) {
        const cuda::TurboRopeArgs args{as_ptr<void>(q), as_ptr<void>(k), as_ptr<void>(v),
                                       as_ptr<const int64_t>(positions), as_ptr<const float>(cos_sin),
                                       as_ptr<uint8_t>(cache), as_ptr<const int64_t>(slots),
                                       as_ptr<const float>(signs), tokens, q_stride, k_stride, v_stride,
                                       static_cast<int>(q_heads), static_cast<int>(kv_heads), k_bits, style,
                                       pair_group, static_cast<float>(std::sqrt(static_cast<double>(head_dim))),
                                       {as_ptr<const void>(norm_rows), norm_stride, hidden, eps}};
        cuda::turbo_rope_cache_write(args, head_dim, to_dtype(dtype), stream);
      },
      "RoPE on q and k (whole heads) and the TurboQuant rows of k and v at their slots in one launch; q comes out "
      "rotated, k and v as their rows decode to (k turned back); norm_rows (0: none): q, k and v are first scaled "
      "by each token's 1/rms of its row");
  m.def("cuda_turbo_tensor_cores_take", &cuda::turbo_decode_tc_takes,
        "whether the tensor-core TurboQuant decode kernel takes (head_dim, k_bits, block_size)");
  m.def(
      "cuda_turbo_blocks_to_dense",
      [](uintptr_t out, uintptr_t cache, uintptr_t blocks, uintptr_t signs, int64_t num_blocks, int64_t block_size,
         int64_t kv_heads, int64_t head_dim, int k_bits, int dtype, uintptr_t stream) {
        cuda::turbo_blocks_to_dense(as_ptr<void>(out), as_ptr<const void>(cache), as_ptr<const int64_t>(blocks),
                                    as_ptr<const float>(signs), num_blocks, block_size, kv_heads, head_dim, k_bits,
                                    to_dtype(dtype), stream);
      },
      "decode the TurboQuant rows of listed blocks into dense f16/bf16 K/V blocks (K turned back)");
  m.def(
      "cuda_argmax",
      [](uintptr_t out, uintptr_t logits, int64_t rows, int64_t vocab, int dtype, uintptr_t stream) {
        cuda::argmax_rows(as_ptr<int64_t>(out), as_ptr<const void>(logits), rows, vocab, to_dtype(dtype), stream);
      },
      "int64 argmax over the last dim of [rows, vocab] logits");
});
#endif  // CANDLE_VLLM_WITH_CUDA
