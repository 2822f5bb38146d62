// GGUF weights against int8-quantized activations (dp4a dot products) for the decode GEMV kernel. Plain integer
// code (GGUF_HD, as gguf_decode.cuh) whose CUDA intrinsics have host fallbacks, so a Part also runs on the host.
//
// Activations: int8 codes per 32-element block plus an XBlock (q8_activation.cuh); the XBlock's code sums give
// the offset and min terms of the weight formulas without per-element work.
//
// A weight block is shared by kParts threads; each thread's Part loads its share of the block's bytes with the
// widest loads the block's alignment allows, turns them into int8-lane words (4 codes per word) plus float
// scales once, and its dot() is then used for every activation row. X<Q> holds the matching activation words.
// Loading is two steps: fetch() only issues the loads into a small Raw (the loaded words as they are),
// decode(raw, blk, p) turns them into the Part's codes and scales.
// Part p's elements, per type:
//  - Q4_0/Q4_1/Q5_0/Q5_1 (kParts 1): the whole 32-element block.
//  - Q8_0 (kParts 2): elements 16p..16p+15.
//  - Q4_K/Q5_K (kParts 4): g = p: elements 64g+[0,32) (sub-block 2g) and 64g+32+[0,32) (sub-block 2g+1).
//  - Q2_K/Q3_K/Q6_K (kParts 4): h = p/2, s = p%2: elements 128h+32q+16s+[0,16) for q = 0..3.
#pragma once
#include "cuda/gguf_q8_block32.cuh"
#include "cuda/gguf_q8_k16.cuh"
#include "cuda/gguf_q8_kquants.cuh"

namespace candle_vllm::gguf {

// Calls f(Q8Dot<Q>{}) for the types with an int8-activation GEMV; false for the others.
template <typename F>
GGUF_HD bool dispatch_q8(int q, F&& f) {
  switch (q) {
    case Q4_0: f(Q8Dot<Q4_0>{}); return true;
    case Q4_1: f(Q8Dot<Q4_1>{}); return true;
    case Q5_0: f(Q8Dot<Q5_0>{}); return true;
    case Q5_1: f(Q8Dot<Q5_1>{}); return true;
    case Q8_0: f(Q8Dot<Q8_0>{}); return true;
    case Q2_K: f(Q8Dot<Q2_K>{}); return true;
    case Q3_K: f(Q8Dot<Q3_K>{}); return true;
    case Q4_K: f(Q8Dot<Q4_K>{}); return true;
    case Q5_K: f(Q8Dot<Q5_K>{}); return true;
    case Q6_K: f(Q8Dot<Q6_K>{}); return true;
    default: return false;
  }
}

}  // namespace candle_vllm::gguf
