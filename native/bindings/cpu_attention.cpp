// Bindings for CPU paged attention (pyengine/ops/attention.py checks shapes, dtypes and contiguity).
#include "bindings/registry.h"
#include "bindings/tensor_arg.h"
#include "cpu/attention.h"

namespace py = pybind11;
using namespace candle_vllm;

static Registrar registrar([](py::module_& m) {
  m.def(
      "cpu_paged_attention",
      [](std::uintptr_t out, std::uintptr_t q, std::uintptr_t kv_cache, std::uintptr_t block_tables,
         std::uintptr_t query_start_loc, std::uintptr_t seq_lens, int64_t num_seqs, int64_t num_tokens,
         int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
         int64_t max_blocks, float scale, int64_t sliding_window, float softcap, int dtype, int cache_dtype,
         int turbo_k_bits, std::uintptr_t turbo_signs) {
        cpu::PagedAttentionArgs a{as_ptr<void>(out), as_ptr<const void>(q), as_ptr<const void>(kv_cache),
                                  as_ptr<const int32_t>(block_tables), as_ptr<const int32_t>(query_start_loc),
                                  as_ptr<const int32_t>(seq_lens), num_seqs, num_tokens, num_q_heads, num_kv_heads,
                                  head_dim, block_size, num_blocks, max_blocks, scale, sliding_window, softcap,
                                  to_dtype(dtype), to_dtype(cache_dtype), turbo_k_bits,
                                  as_ptr<const float>(turbo_signs)};
        py::gil_scoped_release release;
        cpu::paged_attention(a);
      },
      "paged attention over a flattened token batch (prefill chunks and decode alike); the cache holds q's dtype, "
      "e4m3, or TurboQuant rows (cache_dtype uint8, turbo_k_bits 8 / 4 / 3, turbo_signs [D] f32 for 4 / 3)",
      py::arg("out"), py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("query_start_loc"),
      py::arg("seq_lens"), py::arg("num_seqs"), py::arg("num_tokens"), py::arg("num_q_heads"),
      py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"), py::arg("num_blocks"),
      py::arg("max_blocks"), py::arg("scale"), py::arg("sliding_window"), py::arg("softcap"), py::arg("dtype"),
      py::arg("cache_dtype"), py::arg("turbo_k_bits") = 0, py::arg("turbo_signs") = 0);
});
