// A decode step's RMSNorm deferred past the linear it feeds (declared in plain C++ for the bindings).
//
// With the norm's weight folded into the linear's columns (pyengine/models/llama.py fold_norms), the linear can take
// the raw residual rows: its output then lacks only each token's 1 / rms(row), a per-row scale that commutes with
// the linear. The kernel that consumes the output (the RoPE + cache write after qkv, the SiLU after gate/up)
// computes that scale from the rows and applies it, so the norm needs no launch of its own.
//
// The consumer computes the scale before its pdl_wait (common.cuh), so the rows' round trip (from HBM: the linear
// streamed its weight through L2 since the rows were written) and the reduction overlap the linear's run instead of
// following its end. Contract: the rows' writer has ended when the consumer starts. That holds when some kernel
// between them takes an ordinary launch or triggers its dependents only after every one of its threads has passed
// pdl_wait, as the linear reading the rows does: cuBLAS (no programmatic launch), skinny_gemm, skinny_gemm_kn and
// wide_gemm. Kernels that trigger at entry (the small single-pass kernels, the one-token GGUF GEMV, Q6_K's two-token
// one) do not count.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace candle_vllm::cuda {

struct DeferredNorm {
  const void* rows = nullptr;  // [tokens, hidden] in the consumer's dtype, token stride `stride`; null: no norm
  int64_t stride = 0;
  int64_t hidden = 0;
  float eps = 0.f;
  bool before_wait = true;  // the scale computed before pdl_wait; launchers set it (deferred_norm.cuh)
};

// Throws std::invalid_argument naming `what` unless the rows are whole 16-byte vectors (the kernels' loads).
inline void check_deferred_norm(const char* what, const DeferredNorm& n, int64_t elem_size) {
  if (n.rows == nullptr) return;
  const int64_t vec = 16 / elem_size;
  if (n.hidden <= 0 || n.hidden % vec != 0 || n.stride % vec != 0 || reinterpret_cast<std::uintptr_t>(n.rows) % 16 != 0)
    throw std::invalid_argument(std::string(what) + ": the deferred norm's rows need a 16-byte aligned start and a "
                                "hidden size and token stride in whole 16-byte vectors");
}

}  // namespace candle_vllm::cuda
