// Binding for the flash prefill kernel (pyengine/ops/cuda_prefill.py wraps it with the shape/dtype/alignment
// checks). Device pointers cross as integers with the caller's stream handle; the call only enqueues work.
#ifdef CANDLE_VLLM_WITH_CUDA
#include "bindings/registry.h"
#include "bindings/tensor_arg.h"
#include "cuda/flash_prefill.h"

namespace py = pybind11;
using namespace candle_vllm;
using std::uintptr_t;

static Registrar registrar([](py::module_& m) {
  m.def(
      "cuda_flash_prefill",
      [](uintptr_t out, uintptr_t q, uintptr_t key_cache, uintptr_t value_cache, uintptr_t block_tables,
         uintptr_t query_start_loc, uintptr_t seq_lens, int64_t num_seqs, int64_t max_query_len, int64_t q_heads,
         int64_t kv_heads, int64_t head_dim, int64_t q_stride, int64_t block_size, int64_t max_blocks, float scale,
         float softcap, int64_t sliding_window, int64_t block_m, int64_t warp_rows, int64_t block_n,
         bool skip_single_token, int dtype, int cache_dtype, uintptr_t stream) {
        cuda::flash_prefill(as_ptr<void>(out), as_ptr<const void>(q), as_ptr<const void>(key_cache),
                            as_ptr<const void>(value_cache), as_ptr<const int32_t>(block_tables),
                            as_ptr<const int32_t>(query_start_loc), as_ptr<const int32_t>(seq_lens), num_seqs,
                            max_query_len, q_heads, kv_heads, head_dim, q_stride, block_size, max_blocks, scale,
                            softcap, sliding_window, block_m, warp_rows, block_n, skip_single_token,
                            to_dtype(dtype), to_dtype(cache_dtype), stream);
      },
      "variable-length causal flash attention of a step's query rows over the paged KV cache");
});
#endif  // CANDLE_VLLM_WITH_CUDA
