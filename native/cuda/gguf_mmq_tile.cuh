// The weight side of the int8 tensor-core GGUF product (gguf_mmq.cu): what a type's tile loader provides.
//
// A tile loader (one struct per type, e.g. MmqQ4K) is a lane's share of one unit of a weight row: kBlockElems elements
// (kPairs pairs of 32-element sub-blocks; kBlockBytes bytes of the row per unit on average; kType its gguf type code,
// which sizes the row: gguf::row_bytes). fetch(row, u, t) only
// issues the loads of unit u of the row: a global row pointer (gguf_mmq.cu keeps kDepth units in flight while it
// multiplies one more, the first kDepth before griddepcontrol.wait: small units need more of them to cover the memory
// latency), or gguf::StagedBytes, the row's chunk that gguf_mmq_staged.cu staged in shared memory. For sub-blocks
// 2j (lo) and 2j + 1 (hi) the loader then gives the lane's two A-fragment words of each (the sub-block's elements
// 8t..8t+7 as int8 lanes, t = the lane's threadID_in_group; with kSplitLanes elements 4t..4t+3 and 16+4t..16+4t+3,
// the mma's own slots), and their scales, in one of two forms:
// - the 32-element types (kUnitScales false): pair(j, t, lo, hi, a, b), the codes and each sub-block's affine scale,
//   w = a * code - b. kMins is false where b is always 0 (the codes are already signed), so the kernel drops the
//   b * sum(x codes) term.
// - the K-quants (kUnitScales): codes(j, t, lo, hi); unit_scales(d, dmin), the unit's two floats; integer scales and
//   mins, w = d * sc * code - dmin * m: scales_mins(j, sc, m) per sub-block (bytes 0 and 1 of sc and m for 2j and
//   2j + 1), or with kHalfScales half_scales(j, sc) per 16-element half (sc[sub-block][half]: the kernel then takes
//   each half's dot on its own by an m16n8k16 mma per half, so the lanes must hold kSplitLanes' elements, a word of
//   each half), and with kHalfMins half_mins(j, m) likewise (kMins without kHalfMins: per sub-block). The kernel
//   keeps the unit's sums in int32 and meets the floats once per unit, which needs the activations scaled per 256
//   values (q8_activation.cuh).
// Loaders are plain integer code (GGUF_HD), so they also run on the host, where tests/native/host_parts/
// tile_weights.cpp rebuilds each lane's weights from them.
//
// The weight is 16-byte aligned and K a multiple of 256, so the rows of the 32-element types (K / 32 blocks of 18,
// 20, 22, 24 or 34 bytes: whole multiples of 8 blocks) start 16-byte aligned, and their loaders, whose units are a
// whole number of words apart, know each word's alignment at compile time. Q2_K rows (K / 256 blocks of 84 bytes)
// start 4-byte aligned, and its loader reads words; Q3_K, Q6_K, Q8_0 and Q5_0 are stored in 16-byte aligned groups
// (gguf_block.cuh), which their loaders find from the unit's index.
#pragma once
#include <type_traits>

#include "cuda/gguf_q8_words.cuh"

namespace candle_vllm::cuda::mmq {

// A lane's codes (kSplitLanes: elements 4t..4t+3, then 16+4t..16+4t+3) of a 32-element block whose element i < 16
// is the low nibble of code byte i and element 16 + i the high nibble: q is the block's code bytes 4t..4t+3.
GGUF_HD void nibble_codes(uint32_t q, uint32_t (&out)[2]) {
  out[0] = q & gguf::kNib, out[1] = (q >> 4) & gguf::kNib;
}

// Codes of kBits bits (one per byte) minus 2^(kBits - 1), at the top of each int8 lane: 2^(8 - kBits) * (code -
// 2^(kBits - 1)), the offset types' (Q4_0, Q5_0, Q3_K, Q6_K) centered code, with no min term; Q3_K and Q6_K fold
// kCenteredScale<kBits> = 2^-(8 - kBits) into their unit's d, Q4_0 and Q5_0 leave it to the output (kOutputScale).
// One shift and one XOR of the sign bit, where sign-extending each code in place took four integer ops a word (the
// narrow weights' product at 4-8 tokens waits on its integer pipe). The mma's sums grow by the same power of two and
// stay exact (32-element types: |16 * 8 * 127 * 32| < 2^24, so their f32 conversion too; K-quant units: < 2^31), and
// a power of two commutes with f32 rounding, so every f32 the kernels compute equals the unscaled form's bit for bit.
template <int kBits>
GGUF_HD uint32_t centered(uint32_t codes) {
  return (codes << (8 - kBits)) ^ 0x80808080u;
}
template <int kBits>
inline constexpr float kCenteredScale = 1.f / static_cast<float>(1 << (8 - kBits));

// The factor a loader leaves to the output: Q::kOutputScale where it has one, else 1. Q4_0 and Q5_0 hand the mma their
// centered codes (times 2^(8 - b)) with their block scales as stored, so every sum comes out 2^(8 - b) times too
// large, exactly, and the kernels scale it once at the end (gguf_mmq_arith.cuh scale_output) instead of each block's
// scale once a unit: the same bits, since a power of two commutes with f32 rounding.
template <class Q, class = void>
inline constexpr float kOutputScale = 1.f;
template <class Q>
inline constexpr float kOutputScale<Q, std::void_t<decltype(Q::kOutputScale)>> = Q::kOutputScale;

// (a & mask) ^ flip as one LOP3: the compiler splits it in two, since a LOP3 takes one immediate, so the PTX names
// the three-input function (0x6A: a & b ^ c) and ptxas keeps one constant in a register.
GGUF_HD uint32_t and_xor(uint32_t a, uint32_t mask, uint32_t flip) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(a), "r"(mask), "r"(flip));
  return d;
#else
  return (a & mask) ^ flip;
#endif
}

// x shifted left by s bits, or right by -s: s is a constant wherever the loaders' unrolled loops call it.
GGUF_HD uint32_t shift_by(uint32_t x, int s) {
  return s >= 0 ? x << s : x >> -s;
}

// Q4_0's lane codes (nibble_codes' elements) centered at the top of the lanes, as centered<4>: each byte's nibble
// moved to its high half, the sign bit flipped; masking and flipping in one op.
GGUF_HD void centered_nibbles(uint32_t q, uint32_t (&out)[2]) {
  out[0] = and_xor(q << 4, 0xF0F0F0F0u, 0x80808080u), out[1] = and_xor(q, 0xF0F0F0F0u, 0x80808080u);
}

// The fifth bits of those codes from the block's 32-bit qh (bit e = element e), into bit 4 of each byte.
GGUF_HD void add_fifth_bits(uint32_t qh, int t, uint32_t (&codes)[2]) {
  codes[0] |= gguf::bit4_of_bytes(qh >> (4 * t)), codes[1] |= gguf::bit4_of_bytes(qh >> (16 + 4 * t));
}

}  // namespace candle_vllm::cuda::mmq
