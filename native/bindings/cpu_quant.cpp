// Bindings for the GGUF dequantize and quantized-matmul CPU kernels (pyengine/ops/quant.py wraps them).
#include "bindings/registry.h"
#include "bindings/tensor_arg.h"
#include "cpu/quant_dequant.h"
#include "cpu/quant_dot.h"
#include "cpu/quant_gemv.h"

namespace py = pybind11;
using namespace candle_vllm;

static Registrar registrar([](py::module_& m) {
  m.def(
      "cpu_dequantize",
      [](std::uintptr_t out, std::uintptr_t data, int64_t rows, int64_t cols, int qtype, int out_dtype) {
        const cpu::QType t = cpu::to_qtype(qtype);
        const DType dt = to_dtype(out_dtype);
        py::gil_scoped_release release;
        cpu::dequantize(as_ptr<const uint8_t>(data), t, rows, cols, as_ptr<void>(out), dt);
      },
      "out[rows, cols] (f32/f16/bf16) = GGUF blocks of type qtype (a GGMLQuantizationType value) decoded");
  m.def(
      "cpu_quant_matmul",
      [](std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, int64_t m, int64_t n, int64_t k, int qtype, int dtype,
         bool portable) {
        const cpu::QType t = cpu::to_qtype(qtype);
        const DType dt = to_dtype(dtype);
        py::gil_scoped_release release;
        cpu::quant_matmul(as_ptr<const void>(x), dt, as_ptr<const uint8_t>(w), t, m, n, k, as_ptr<void>(y), portable);
      },
      "y[m, n] = x[m, k] @ W.T, W given as GGUF blocks of type qtype; portable=True skips the SIMD kernels");
  m.def("cpu_quant_isa", []() { return std::string(cpu::dot_kernel_isa()); },
        "instruction set of the quantized matmul kernels: 'avx2' or 'portable'");
});
