// Tile loaders of the int8 tensor-core GGUF product for the 32-element types Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
// (contract: gguf_mmq_tile.cuh). A unit is two blocks (one pair of sub-blocks): its start is then 4-byte aligned
// (8-byte for Q4_1 and Q5_1), where a single 18-byte Q4_0 block is only 2-byte aligned. Where a lane's code bytes
// start 2 bytes off a word, it loads the words around them and shifts (mid16). Q8_0 and Q5_0 are grouped
// (gguf_block.cuh), every load aligned. Word indices below are of the unit's 32-bit words.
#pragma once
#include "cuda/gguf_mmq_tile.cuh"

namespace candle_vllm::cuda::mmq {

template <class P>
GGUF_HD uint32_t word(P unit, int i) {
  return gguf::ld<uint32_t>(unit + 4 * i);
}

// Q8_0 (34 bytes: f16 d, 32 int8 codes), in the CUDA layout (gguf_block.cuh): the unit's two blocks are slots 2i,
// 2i + 1 of a group (found from the unit's index: grouped_body_at), so their codes are two adjacent 32-byte bodies
// (the lane's 8 bytes of each one 8-byte load) and their d's one word of the header.
struct MmqQ8_0 {
  static constexpr int kType = gguf::Q8_0;
  static constexpr int kBlockElems = 64, kBlockBytes = 68, kPairs = 1, kDepth = 4;
  static constexpr bool kUnitScales = false, kMins = false, kSplitLanes = false;
  uint2 e, o;
  uint32_t ds;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P body = gguf::grouped_body_at<gguf::Q8_0>(row, 2 * u);
    e = gguf::ld<uint2>(body + 8 * t), o = gguf::ld<uint2>(body + (32 + 8 * t));
    ds = gguf::ld<uint32_t>(gguf::grouped_field_at<gguf::Q8_0>(row, 2 * u, gguf::kBlock32D));
  }
  GGUF_HD void pair(int, int, uint32_t (&lo)[2], uint32_t (&hi)[2], float (&a)[2], float (&b)[2]) const {
    lo[0] = e.x, lo[1] = e.y;
    hi[0] = o.x, hi[1] = o.y;
    a[0] = gguf::half_lo(ds), a[1] = gguf::half_hi(ds);
    b[0] = b[1] = 0.f;
  }
};

// Codes w = d * (code - 2^(kBits-1)) of a unit's two blocks: lo and hi centered to int8 lanes, a = the blocks' d's
// (their kCenteredScale left to the output: kOutputScale), no min term (Q5_0).
template <int kBits>
GGUF_HD void centered_blocks(uint32_t (&lo)[2], uint32_t (&hi)[2], float d0, float d1, float (&a)[2],
                             float (&b)[2]) {
#pragma unroll
  for (int k = 0; k < 2; ++k) lo[k] = centered<kBits>(lo[k]), hi[k] = centered<kBits>(hi[k]);
  a[0] = d0, a[1] = d1;
  b[0] = b[1] = 0.f;
}

// The nibble types keep the mma's own slots (kSplitLanes): lane t takes code bytes 4t..4t+3 of a block, whose low
// nibbles are elements 4t..4t+3 and high nibbles 16+4t..16+4t+3, one word per block.

// Q4_0 (18 bytes: f16 d, 16 code bytes; w = d * (code - 8), the codes centered): block 0's lane word is bytes
// 2+4t.. (words t, t+1), block 1's bytes 20+4t.. (word 5+t); the d's are the low half of word 0 and the high half
// of word 4.
struct MmqQ4_0 {
  static constexpr int kType = gguf::Q4_0;
  static constexpr int kBlockElems = 64, kBlockBytes = 36, kPairs = 1, kDepth = 4;
  static constexpr bool kUnitScales = false, kMins = false, kSplitLanes = true;
  static constexpr float kOutputScale = kCenteredScale<4>;
  uint32_t e[2], o, d0, d1;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P unit = row + static_cast<int64_t>(u) * kBlockBytes;
    e[0] = word(unit, t), e[1] = word(unit, t + 1), o = word(unit, 5 + t);
    d0 = word(unit, 0), d1 = word(unit, 4);
  }
  GGUF_HD void pair(int, int, uint32_t (&lo)[2], uint32_t (&hi)[2], float (&a)[2], float (&b)[2]) const {
    centered_nibbles(gguf::mid16(e[0], e[1]), lo);
    centered_nibbles(o, hi);
    a[0] = gguf::half_lo(d0), a[1] = gguf::half_hi(d1);
    b[0] = b[1] = 0.f;
  }
};

// Q4_1 (20 bytes: f16 d, f16 m, 16 code bytes; w = d * code + m): block 0's dm is word 0 and its lane word word
// 1+t; block 1's dm word 5 and its lane word word 6+t.
struct MmqQ4_1 {
  static constexpr int kType = gguf::Q4_1;
  static constexpr int kBlockElems = 64, kBlockBytes = 40, kPairs = 1, kDepth = 4;
  static constexpr bool kUnitScales = false, kMins = true, kSplitLanes = true;
  uint32_t e, o, dm0, dm1;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P unit = row + static_cast<int64_t>(u) * kBlockBytes;
    e = word(unit, 1 + t), o = word(unit, 6 + t);
    dm0 = word(unit, 0), dm1 = word(unit, 5);
  }
  GGUF_HD void pair(int, int, uint32_t (&lo)[2], uint32_t (&hi)[2], float (&a)[2], float (&b)[2]) const {
    nibble_codes(e, lo);
    nibble_codes(o, hi);
    a[0] = gguf::half_lo(dm0), a[1] = gguf::half_lo(dm1);
    b[0] = -gguf::half_hi(dm0), b[1] = -gguf::half_hi(dm1);
  }
};

// Q5_0 (22 bytes: f16 d, 32-bit qh, 16 code bytes; w = d * (code - 16), the codes centered), in the CUDA layout
// (gguf_block.cuh): the unit's two blocks are slots 2i, 2i + 1 of a group, so their lane words are word t of two
// adjacent 16-byte bodies, their qh words one 8-byte load and their d's one word of the header.
struct MmqQ5_0 {
  static constexpr int kType = gguf::Q5_0;
  static constexpr int kBlockElems = 64, kBlockBytes = 44, kPairs = 1, kDepth = 4;
  static constexpr bool kUnitScales = false, kMins = false, kSplitLanes = true;
  static constexpr float kOutputScale = kCenteredScale<5>;
  uint32_t e, o, ds;
  uint2 qh;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P body = gguf::grouped_body_at<gguf::Q5_0>(row, 2 * u);
    e = word(body, t), o = word(body, 4 + t);
    qh = gguf::ld<uint2>(gguf::grouped_field_at<gguf::Q5_0>(row, 2 * u, gguf::kQ5_0Qh));
    ds = gguf::ld<uint32_t>(gguf::grouped_field_at<gguf::Q5_0>(row, 2 * u, gguf::kBlock32D));
  }
  GGUF_HD void pair(int, int t, uint32_t (&lo)[2], uint32_t (&hi)[2], float (&a)[2], float (&b)[2]) const {
    nibble_codes(e, lo);
    add_fifth_bits(qh.x, t, lo);
    nibble_codes(o, hi);
    add_fifth_bits(qh.y, t, hi);
    centered_blocks<5>(lo, hi, gguf::half_lo(ds), gguf::half_hi(ds), a, b);
  }
};

// Q5_1 (24 bytes: f16 d, f16 m, 32-bit qh, 16 code bytes; w = d * code + m), 8-byte aligned: block 0's dm and qh are
// words 0, 1 and its lane word word 2+t; block 1's words 6, 7 and 8+t.
struct MmqQ5_1 {
  static constexpr int kType = gguf::Q5_1;
  static constexpr int kBlockElems = 64, kBlockBytes = 48, kPairs = 1, kDepth = 4;
  static constexpr bool kUnitScales = false, kMins = true, kSplitLanes = true;
  uint2 h0, h1;
  uint32_t e, o;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P unit = row + static_cast<int64_t>(u) * kBlockBytes;
    h0 = gguf::ld<uint2>(unit), e = word(unit, 2 + t);
    h1 = gguf::ld<uint2>(unit + 24), o = word(unit, 8 + t);
  }
  GGUF_HD void pair(int, int t, uint32_t (&lo)[2], uint32_t (&hi)[2], float (&a)[2], float (&b)[2]) const {
    nibble_codes(e, lo);
    add_fifth_bits(h0.y, t, lo);
    nibble_codes(o, hi);
    add_fifth_bits(h1.y, t, hi);
    a[0] = gguf::half_lo(h0.x), a[1] = gguf::half_lo(h1.x);
    b[0] = -gguf::half_hi(h0.x), b[1] = -gguf::half_hi(h1.x);
  }
};

}  // namespace candle_vllm::cuda::mmq
