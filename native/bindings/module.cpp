// The candle_vllm._native extension: collects the binding groups registered by the other bindings/*.cpp files.
#include "registry.h"

namespace candle_vllm {
std::vector<BindingGroup>& binding_groups() {
  static std::vector<BindingGroup> groups;
  return groups;
}
}  // namespace candle_vllm

PYBIND11_MODULE(_native, m) {
  m.doc() = "candle-vllm native kernels (CPU always; CUDA when built with CANDLE_VLLM_CUDA)";
#ifdef CANDLE_VLLM_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  for (auto& group : candle_vllm::binding_groups()) group(m);
}
