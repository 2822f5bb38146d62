// The native module never links libtorch: a tensor crosses the boundary as (data pointer, dtype code) plus
// sizes passed as plain integers. The Python wrappers in pyengine/ops/native.py check device, dtype, shape and
// contiguity before calling, so kernels here may assume contiguous row-major buffers.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace candle_vllm {

// Must match pyengine/ops/native.py::DTYPE_CODES.
// F8E4M3: the e4m3 KV cache of --kvcache-dtype fp8 (cuda/fp8_kv.cuh).
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, U8 = 3, I32 = 4, I64 = 5, F8E4M3 = 6 };

inline DType to_dtype(int code) {
  if (code < 0 || code > 6) throw std::invalid_argument("unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

template <typename T>
inline T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace candle_vllm
