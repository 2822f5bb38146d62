// Bindings for the GGUF CUDA kernels (pyengine/ops/cuda_gguf.py checks shapes, dtypes and alignment first).
// Device pointers cross as integers with the caller's stream; the calls only enqueue work (graph capturable).
#ifdef CANDLE_VLLM_WITH_CUDA
#include "bindings/registry.h"
#include "bindings/tensor_arg.h"
#include "cuda/gguf.h"

namespace py = pybind11;
using namespace candle_vllm;
using std::uintptr_t;

static Registrar registrar([](py::module_& m) {
  m.def("cuda_gguf_supported", &cuda::gguf_supported, "whether the CUDA kernels decode this GGUF type code");
  m.attr("cuda_gguf_gemv_max_m") = cuda::kGgufGemvMaxM;
  m.def(
      "cuda_gguf_dequantize",
      [](uintptr_t out, uintptr_t w, uintptr_t ids, int64_t rows, int64_t cols, int qtype, int dtype,
         uintptr_t stream) {
        cuda::gguf_dequantize(as_ptr<void>(out), as_ptr<const uint8_t>(w), as_ptr<const int64_t>(ids), rows, cols,
                              qtype, to_dtype(dtype), stream);
      },
      "out[r] = decoded row ids[r] (or r when ids is 0) of GGUF blocks w");
  m.def(
      "cuda_gguf_gemv",
      [](uintptr_t y, uintptr_t x, uintptr_t w, int64_t M, int64_t N, int64_t K, int qtype, int dtype,
         uintptr_t stream) {
        cuda::gguf_gemv(as_ptr<void>(y), as_ptr<const void>(x), as_ptr<const uint8_t>(w), M, N, K, qtype,
                        to_dtype(dtype), stream);
      },
      "y[M,N] = x[M,K] @ W[N,K]^T for M <= 8, W in GGUF blocks (fused dequantize)");
  m.def("cuda_gguf_gemv_q8_supported", &cuda::gguf_gemv_q8_supported,
        "whether cuda_gguf_gemv_q8 (int8 activations, dp4a) decodes this GGUF type code");
  m.attr("cuda_gguf_xblock_bytes") = cuda::kGgufXBlockBytes;
  m.def(
      "cuda_gguf_gemv_q8",
      [](uintptr_t y, uintptr_t x, uintptr_t xq, uintptr_t xb, uintptr_t w, int64_t M, int64_t N, int64_t K,
         int qtype, int dtype, uintptr_t stream, int rows) {
        cuda::gguf_gemv_q8(as_ptr<void>(y), as_ptr<const void>(x), as_ptr<int8_t>(xq), as_ptr<void>(xb),
                           as_ptr<const uint8_t>(w), M, N, K, qtype, to_dtype(dtype), stream, rows);
      },
      py::arg("y"), py::arg("x"), py::arg("xq"), py::arg("xb"), py::arg("w"), py::arg("M"), py::arg("N"), py::arg("K"),
      py::arg("qtype"), py::arg("dtype"), py::arg("stream"), py::arg("rows") = 0,
      "y[M,N] = x[M,K] @ W[N,K]^T for M <= 8: x quantized to int8 blocks into scratch xq/xb, then dp4a; rows per "
      "CTA 2/4/8 (2/4 from three tokens), 0 = default rule; same bits");
  m.def(
      "cuda_gguf_gemv_q8_quantized",
      [](uintptr_t y, uintptr_t xq, uintptr_t xb, uintptr_t w, int64_t M, int64_t N, int64_t K, int qtype, int dtype,
         uintptr_t stream, int rows) {
        cuda::gguf_gemv_q8_quantized(as_ptr<void>(y), as_ptr<const int8_t>(xq), as_ptr<const void>(xb),
                                     as_ptr<const uint8_t>(w), M, N, K, qtype, to_dtype(dtype), stream, rows);
      },
      py::arg("y"), py::arg("xq"), py::arg("xb"), py::arg("w"), py::arg("M"), py::arg("N"), py::arg("K"),
      py::arg("qtype"), py::arg("dtype"), py::arg("stream"), py::arg("rows") = 0,
      "cuda_gguf_gemv_q8 on activations a norm/SiLU kernel already quantized into xq/xb (no quantizer launch)");
  m.def("cuda_gguf_mmq_x_group", &cuda::gguf_mmq_x_group, py::arg("qtype"),
        "values per activation scale cuda_gguf_mmq takes for the GGUF type (256 for the K-quants, 32 for the others)");
  m.def("cuda_gguf_mmq_warps", &cuda::gguf_mmq_warps, py::arg("qtype"), py::arg("M"), py::arg("N"), py::arg("K"),
        "warps splitting K in cuda_gguf_mmq's default launch of M tokens on an N x K weight (its f32 summation order)");
  m.def("cuda_gguf_mmq_supported", &cuda::gguf_mmq_supported,
        "whether cuda_gguf_mmq (int8 tensor cores, decode batches up to cuda_gguf_mmq_max_m) decodes this GGUF type");
  m.attr("cuda_gguf_mmq_max_m") = cuda::kGgufMmqMaxM;
  m.def(
      "cuda_gguf_mmq",
      [](uintptr_t y, uintptr_t x, uintptr_t xq, uintptr_t xb, uintptr_t w, int64_t M, int64_t N, int64_t K,
         int qtype, int dtype, uintptr_t stream, int row_tiles, int warps, int staging) {
        cuda::gguf_mmq(as_ptr<void>(y), as_ptr<const void>(x), as_ptr<int8_t>(xq), as_ptr<void>(xb),
                       as_ptr<const uint8_t>(w), M, N, K, qtype, to_dtype(dtype), stream, row_tiles, warps, staging);
      },
      py::arg("y"), py::arg("x"), py::arg("xq"), py::arg("xb"), py::arg("w"), py::arg("M"), py::arg("N"), py::arg("K"),
      py::arg("qtype"), py::arg("dtype"), py::arg("stream"), py::arg("row_tiles") = 0, py::arg("warps") = 0,
      py::arg("staging") = 0,
      "cuda_gguf_gemv_q8's product for up to cuda_gguf_mmq_max_m tokens on int8 tensor cores (x = 0: codes already "
      "in xq/xb, of cuda_gguf_mmq_x_group's scale group; row_tiles: 16-row tiles per CTA, warps: warps per CTA "
      "splitting K, staging: 1 the register kernel, 2 the shared-memory kernel (up to cuda_gguf_mmq_staged_max_m "
      "tokens, Hopper, no row_tiles); 0 = default rules)");
  m.attr("cuda_gguf_mmq_staged_max_m") = cuda::kGgufMmqStagedMaxM;
  m.def("cuda_gguf_mmq_staged_fits", &cuda::gguf_mmq_staged_fits, py::arg("qtype"), py::arg("M"), py::arg("K"),
        "whether cuda_gguf_mmq's staged kernel takes M tokens of a qtype weight with K columns on the current device "
        "(Hopper, M <= cuda_gguf_mmq_staged_max_m, rows a whole number of 16-byte granules)");
  m.def(
      "cuda_gguf_gemv_q8_rope_cache",
      [](uintptr_t y, uintptr_t x, uintptr_t xq, uintptr_t xb, uintptr_t w, int64_t M, int64_t N, int64_t K,
         int qtype, int dtype, uintptr_t positions, uintptr_t cos_sin, uintptr_t key_cache, uintptr_t value_cache,
         uintptr_t slots, int q_rows, int rot_rows, int head_dim, int kv_heads, uintptr_t stream, int rows,
         bool tensor_cores, bool cache_e4m3) {
        const cuda::GgufRopeCache rope{as_ptr<const int64_t>(positions), as_ptr<const float>(cos_sin),
                                       as_ptr<void>(key_cache), as_ptr<void>(value_cache),
                                       as_ptr<const int64_t>(slots), q_rows, rot_rows, head_dim, kv_heads, cache_e4m3};
        cuda::gguf_gemv_q8_rope_cache(as_ptr<void>(y), as_ptr<const void>(x), as_ptr<int8_t>(xq), as_ptr<void>(xb),
                                      as_ptr<const uint8_t>(w), M, N, K, qtype, to_dtype(dtype), rope, stream, rows,
                                      tensor_cores);
      },
      py::arg("y"), py::arg("x"), py::arg("xq"), py::arg("xb"), py::arg("w"), py::arg("M"), py::arg("N"), py::arg("K"),
      py::arg("qtype"), py::arg("dtype"), py::arg("positions"), py::arg("cos_sin"), py::arg("key_cache"),
      py::arg("value_cache"), py::arg("slots"), py::arg("q_rows"), py::arg("rot_rows"), py::arg("head_dim"),
      py::arg("kv_heads"), py::arg("stream"), py::arg("rows") = 0, py::arg("tensor_cores") = false,
      py::arg("cache_e4m3") = false,
      "cuda_gguf_gemv_q8 (x = 0: codes already in xq/xb; tensor_cores: cuda_gguf_mmq's product, whose codes must then "
      "be of cuda_gguf_mmq_x_group's scale group) of a fused qkv weight "
      "whose q/k heads have their halves interleaved in adjacent row pairs, with neox RoPE on q/k and the k/v cache "
      "store in the epilogue (y in the standard head layout; cache_e4m3: the cache holds e4m3)");
  m.def("cuda_gguf_gemv_q8_rows", &cuda::gguf_gemv_q8_rows, py::arg("qtype"), py::arg("M"), py::arg("N"),
        py::arg("K"), py::arg("rows") = 0,
        "rows per CTA cuda_gguf_gemv_q8 launches with for M tokens and an N x K weight on the current device (rows = "
        "0 resolved by the default rule)");
});
#endif  // CANDLE_VLLM_WITH_CUDA
