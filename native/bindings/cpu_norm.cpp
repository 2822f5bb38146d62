// Bindings for the CPU RMSNorm kernels (pyengine/ops/norm.py wraps them).
#include "bindings/registry.h"
#include "bindings/tensor_arg.h"
#include "cpu/norm.h"

namespace py = pybind11;
using namespace candle_vllm;

static Registrar registrar([](py::module_& m) {
  m.def(
      "cpu_rms_norm",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t weight, int64_t rows, int64_t hidden, float eps, int dtype) {
        py::gil_scoped_release release;
        cpu::rms_norm(as_ptr<void>(out), as_ptr<const void>(x), as_ptr<const void>(weight), rows, hidden, eps, to_dtype(dtype));
      },
      "out = x / rms(x) * weight over contiguous rows");
  m.def(
      "cpu_fused_add_rms_norm",
      [](std::uintptr_t x, std::uintptr_t residual, std::uintptr_t weight, int64_t rows, int64_t hidden, float eps, int dtype) {
        py::gil_scoped_release release;
        cpu::fused_add_rms_norm(as_ptr<void>(x), as_ptr<void>(residual), as_ptr<const void>(weight), rows, hidden, eps, to_dtype(dtype));
      },
      "in place: residual += x; x = rms_norm(residual) * weight");
});
