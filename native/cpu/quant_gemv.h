// y = x @ W.T with W stored as GGUF blocks: the CPU decode hot path. Each weight row is read from memory once
// per call and dotted against all activation rows while it sits in L1; output rows are split across OpenMP
// threads.
#pragma once
#include <cstdint>
#include <vector>

#include "bindings/tensor_arg.h"
#include "cpu/quant_blocks.h"
#include "cpu/quant_dot.h"

namespace candle_vllm::cpu {

// x: [m, k] contiguous (f32/f16/bf16), w: [n, k/block * bytes] blocks of `t`, y: [m, n] in x's dtype.
// `portable` forces the portable kernels (tests use it to check them on AVX2 machines).
void quant_matmul(const void* x, DType dtype, const uint8_t* w, QType t, int64_t m, int64_t n, int64_t k, void* y,
                  bool portable);

// The same matmul in two steps, for callers already inside an OpenMP parallel region (the fused decoder layer):
// one thread prepares the activations, then every thread of the region computes its share of y. The result is
// bitwise that of quant_matmul: each output element is one dot product whichever thread computes it.
struct MatmulActs {
  std::vector<uint8_t> bytes;  // x converted to what the kernel for the weight type reads
  int64_t stride = 0;          // bytes per activation row
  DotKernel kernel{};
  int64_t m = 0, k = 0;
};

// Fills `a` for a weight of type `t` (throws when k is not a whole number of blocks).
void prepare_matmul_acts(const void* x, DType dtype, QType t, int64_t m, int64_t k, bool portable, MatmulActs& a);

// This thread's share of y[:, :n] (row stride ldy elements, in `ydtype`) = acts @ W.T. Called by every thread
// of the enclosing parallel region (or alone outside one); no barrier at the end.
void quant_matmul_share(const MatmulActs& a, const uint8_t* w, QType t, int64_t n, void* y, int64_t ldy,
                        DType ydtype);

}  // namespace candle_vllm::cpu
