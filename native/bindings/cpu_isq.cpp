// Binding for the ISQ CPU quantizer (pyengine/quant/isq.py wraps it).
#include "bindings/registry.h"
#include "bindings/tensor_arg.h"
#include "cpu/quant_quantize.h"

namespace py = pybind11;
using namespace candle_vllm;

static Registrar registrar([](py::module_& m) {
  m.def(
      "cpu_isq_quantize",
      [](std::uintptr_t out, std::uintptr_t x, int64_t rows, int64_t cols, int x_dtype, int qtype) {
        const cpu::QType t = cpu::to_qtype(qtype);
        const DType dt = to_dtype(x_dtype);
        py::gil_scoped_release release;
        cpu::quantize_rows(as_ptr<const void>(x), dt, rows, cols, t, as_ptr<uint8_t>(out));
      },
      "out[rows, row_bytes] = x[rows, cols] (f32/f16/bf16) quantized to GGUF blocks of type qtype (a "
      "GGMLQuantizationType value) with llama.cpp's reference quantizers");
});
