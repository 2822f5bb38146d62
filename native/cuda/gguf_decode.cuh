// GGUF (ggml) block decoding shared by the CUDA dequantize and fused GEMV kernels.
//
// Two decoders per type, both plain integer/float code that also compiles on the host (so the bit layouts can be
// checked against the `gguf` package without a GPU):
//  - Deq<Q>::slice: 32 consecutive elements of a block as f32, with gguf's own order of f32 operations (each
//    product and sum rounded separately), so a dequantized f32 tensor equals gguf.quants.dequantize exactly.
//  - Deq<Q>::codes / elem / scales: the GEMV's view. A warp's lane t (of the 4 lanes sharing a weight row in an
//    mma fragment) takes, in each 32-element step s of a 256-element unit, 4 pairs of adjacent elements. codes()
//    returns each pair's two unsigned codes at bits 0 and 16 of a word, elem() the pair's first element within
//    the unit, and scales() an (a, b) per pair so that w = (code - kOffset) * a + b. Adjacent elements let the
//    activations be fetched as aligned 4-byte pairs; the pairs are picked so each lane needs few scales per block.
// A unit is 8 blocks of the 32-element types and one block of the 256-element (K) types.
#pragma once
#include "cuda/gguf_decode_block32.cuh"
#include "cuda/gguf_decode_kquants.cuh"

namespace candle_vllm::gguf {

// Calls f(Deq<Q>{}) for a runtime type code; returns false for codes without a decoder.
template <typename F>
GGUF_HD bool dispatch_qtype(int q, F&& f) {
  switch (q) {
    case Q4_0: f(Deq<Q4_0>{}); return true;
    case Q4_1: f(Deq<Q4_1>{}); return true;
    case Q5_0: f(Deq<Q5_0>{}); return true;
    case Q5_1: f(Deq<Q5_1>{}); return true;
    case Q8_0: f(Deq<Q8_0>{}); return true;
    case Q2_K: f(Deq<Q2_K>{}); return true;
    case Q3_K: f(Deq<Q3_K>{}); return true;
    case Q4_K: f(Deq<Q4_K>{}); return true;
    case Q5_K: f(Deq<Q5_K>{}); return true;
    case Q6_K: f(Deq<Q6_K>{}); return true;
    default: return false;
  }
}

}  // namespace candle_vllm::gguf
