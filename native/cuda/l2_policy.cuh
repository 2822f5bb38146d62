// L2 eviction policies for the read-once streams of a decode step.
//
// A decode step reads each weight, and in the attention each sequence's K/V, exactly once: hundreds of MB per
// layer through a 50 MB L2. Loaded with the default policy, every such line pushes out an older one, whatever it
// holds; loaded evict-first, a stream recycles its own lines and leaves the rest of L2 to data that is read again
// (the residual, activations, the split-KV partials). Which streams take evict-first was measured end to end
// (benches/RESULTS.md, session 23); CANDLE_VLLM_L2_EVICT_FIRST (a bitmask of L2Stream, "0": none) overrides it,
// as an A/B switch for benchmarks. It is read at each launch, so one process can compare, and a CUDA graph keeps
// what was set when it was captured.
#pragma once
#include <cstdint>
#include <cstdlib>

namespace candle_vllm::cuda {

enum L2Stream : int { kL2KvCache = 1, kL2WideGemmWeights = 2, kL2SkinnyGemmWeights = 4 };
constexpr int kL2EvictFirstDefault = kL2KvCache;

inline bool l2_evict_first(L2Stream stream) {
  const char* v = std::getenv("CANDLE_VLLM_L2_EVICT_FIRST");
  return ((v == nullptr ? kL2EvictFirstDefault : std::atoi(v)) & stream) != 0;
}

// The cache policy operand of the .L2::cache_hint loads. Streams switched off load without a hint: an explicit
// evict-normal policy measured slower than none (session 23: the attention 69.5 vs 65.7 us per layer at batch 64).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

}  // namespace candle_vllm::cuda
