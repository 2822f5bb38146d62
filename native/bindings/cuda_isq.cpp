// Binding for the ISQ CUDA quantizer (pyengine/quant/isq.py checks device, dtype, shape and contiguity first).
#ifdef CANDLE_VLLM_WITH_CUDA
#include "bindings/registry.h"
#include "bindings/tensor_arg.h"
#include "cuda/isq_quantize.h"

namespace py = pybind11;
using namespace candle_vllm;
using std::uintptr_t;

static Registrar registrar([](py::module_& m) {
  m.def(
      "cuda_isq_quantize",
      [](uintptr_t out, uintptr_t x, int64_t rows, int64_t cols, int x_dtype, int qtype, uintptr_t stream) {
        cuda::isq_quantize(as_ptr<uint8_t>(out), as_ptr<const void>(x), rows, cols, to_dtype(x_dtype), qtype, stream);
      },
      "out[rows, row_bytes] = x[rows, cols] (device f32/f16/bf16) quantized to GGUF blocks of type qtype; "
      "byte-equal to cpu_isq_quantize");
});
#endif  // CANDLE_VLLM_WITH_CUDA
