// Self-registration of binding groups: each bindings/*.cpp adds its functions to the module through a
// static Registrar, so adding a kernel family never edits module.cpp.
#pragma once
#include <pybind11/pybind11.h>

#include <functional>
#include <vector>

namespace candle_vllm {

using BindingGroup = std::function<void(pybind11::module_&)>;

std::vector<BindingGroup>& binding_groups();

struct Registrar {
  explicit Registrar(BindingGroup group) { binding_groups().push_back(std::move(group)); }
};

}  // namespace candle_vllm
