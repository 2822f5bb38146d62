// Tile loaders of the int8 tensor-core GGUF product for the K-quants (contract: gguf_mmq_tile.cuh, kUnitScales):
// Q4_K and Q5_K one 256-element block per unit, its 16-byte header decoded per pair of sub-blocks; Q2_K, Q3_K and
// Q6_K (16-element scales) half a block.
#pragma once
#include "cuda/gguf_mmq_tile.cuh"
#include "cuda/gguf_q8_kquants.cuh"

namespace candle_vllm::cuda::mmq {

// The Q4_K / Q5_K block header h (its first 16 bytes: f16 d, dmin, 12 bytes of packed 6-bit scales and mins): the
// unit's d, dmin, and the integer scales and mins of sub-blocks 2j, 2j + 1 (bytes 0 and 1 of sc and m).
GGUF_HD void k4_unit_scales(const uint4& h, float& d, float& dmin) {
  d = gguf::half_lo(h.x), dmin = gguf::half_hi(h.x);
}
GGUF_HD void k4_scales_mins(const uint4& h, int j, uint32_t& sc, uint32_t& m) {
  gguf::k4_scale_min_pair(h.y, h.z, h.w, j, sc, m);
}

// Q4_K (144 bytes: the header, then 128 code bytes whose pair j holds sub-blocks 2j and 2j+1 in the low and high
// nibbles of bytes 16 + 32j ..): bytes 8t..8t+7 of each pair.
struct MmqQ4K {
  static constexpr int kType = gguf::Q4_K;
  static constexpr int kBlockElems = 256, kBlockBytes = 144, kPairs = 4;
  static constexpr int kDepth = 1;
  static constexpr bool kUnitScales = true, kMins = true, kSplitLanes = false, kHalfScales = false;
  static constexpr bool kHalfMins = false;
  uint2 q[kPairs];
  uint4 h;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P blk = row + static_cast<int64_t>(u) * kBlockBytes;
    h = gguf::ld<uint4>(blk);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) q[j] = gguf::ld<uint2>(blk + 16 + 32 * j + 8 * t);
  }
  GGUF_HD void codes(int j, int, uint32_t (&lo)[2], uint32_t (&hi)[2]) const {
    lo[0] = q[j].x & gguf::kNib, lo[1] = q[j].y & gguf::kNib;
    hi[0] = (q[j].x >> 4) & gguf::kNib, hi[1] = (q[j].y >> 4) & gguf::kNib;
  }
  GGUF_HD void unit_scales(float& d, float& dmin) const { k4_unit_scales(h, d, dmin); }
  GGUF_HD void scales_mins(int j, uint32_t& sc, uint32_t& m) const { k4_scales_mins(h, j, sc, m); }
};

// Q5_K (176 bytes: the header, 32 bytes whose byte i holds the fifth bit of element i of sub-block s in bit s, then
// the low nibbles as Q4_K holds its codes): Q4_K's lane share plus the lane's 8 bytes of fifth bits.
struct MmqQ5K {
  static constexpr int kType = gguf::Q5_K;
  static constexpr int kBlockElems = 256, kBlockBytes = 176, kPairs = 4;
  static constexpr int kDepth = 1;
  static constexpr bool kUnitScales = true, kMins = true, kSplitLanes = false, kHalfScales = false;
  static constexpr bool kHalfMins = false;
  uint2 q[kPairs], e;
  uint4 h;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P blk = row + static_cast<int64_t>(u) * kBlockBytes;
    h = gguf::ld<uint4>(blk);
    e = gguf::ld<uint2>(blk + 16 + 8 * t);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) q[j] = gguf::ld<uint2>(blk + 48 + 32 * j + 8 * t);
  }
  GGUF_HD void codes(int j, int, uint32_t (&lo)[2], uint32_t (&hi)[2]) const {
    const uint32_t qs[2] = {q[j].x, q[j].y}, qh[2] = {e.x, e.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      lo[k] = (qs[k] & gguf::kNib) | (((qh[k] >> (2 * j)) & 0x01010101u) << 4);
      hi[k] = ((qs[k] >> 4) & gguf::kNib) | (((qh[k] >> (2 * j + 1)) & 0x01010101u) << 4);
    }
  }
  GGUF_HD void unit_scales(float& d, float& dmin) const { k4_unit_scales(h, d, dmin); }
  GGUF_HD void scales_mins(int j, uint32_t& sc, uint32_t& m) const { k4_scales_mins(h, j, sc, m); }
};

// The 32-element sub-blocks of half n of a Q2_K/Q3_K block (elements 128n + 32q + [0, 32), q = 0..3) take bits 2q,
// 2q + 1 of code bytes 32n + [0, 32) of the block's 2-bit plane; lane t's elements (kSplitLanes: 4t..4t+3 of the
// first half, 16+4t..16+4t+3 of the second) of each are those bytes of the plane's 32, so one pair of words serves
// all four. Their 16-element halves are the 16 sub-blocks of
// the block's scales, sub-block q's half h being scale 8n + 2q + h (byte 2i + h of the n-th half's word j for
// q = 2j + i).
GGUF_HD uint32_t plane2(uint32_t w, int q) { return (w >> (2 * q)) & 0x03030303u; }

// Q2_K (84 bytes: 16 scale bytes, the low nibble the sub-block's scale and the high its min; 64 code bytes; f16 d,
// dmin; w = d * sc * code - dmin * m): half a block per unit, 4-byte aligned (blocks are 84 bytes apart).
struct MmqQ2K {
  static constexpr int kType = gguf::Q2_K;
  static constexpr int kBlockElems = 128, kBlockBytes = 42, kPairs = 2, kDepth = 1;
  static constexpr bool kUnitScales = true, kMins = true, kSplitLanes = true, kHalfScales = true, kHalfMins = true;
  uint32_t q[2], sm[2], dm;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P blk = row + static_cast<int64_t>(u >> 1) * (2 * kBlockBytes);
    const int n = u & 1;
    q[0] = gguf::ld<uint32_t>(blk + 16 + 32 * n + 4 * t), q[1] = gguf::ld<uint32_t>(blk + 32 + 32 * n + 4 * t);
    sm[0] = gguf::ld<uint32_t>(blk + 8 * n), sm[1] = gguf::ld<uint32_t>(blk + 8 * n + 4);
    dm = gguf::ld<uint32_t>(blk + 80);
  }
  GGUF_HD void codes(int j, int, uint32_t (&lo)[2], uint32_t (&hi)[2]) const {
#pragma unroll
    for (int k = 0; k < 2; ++k) lo[k] = plane2(q[k], 2 * j), hi[k] = plane2(q[k], 2 * j + 1);
  }
  GGUF_HD void unit_scales(float& d, float& dmin) const { d = gguf::half_lo(dm), dmin = gguf::half_hi(dm); }
  GGUF_HD void half_scales(int j, int (&s)[2][2]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i >> 1][i & 1] = (sm[j] >> (8 * i)) & 0xF;
  }
  GGUF_HD void half_mins(int j, int (&m)[2][2]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) m[i >> 1][i & 1] = (sm[j] >> (8 * i + 4)) & 0xF;
  }
};

// Q3_K (110 bytes: 32 bytes of high bits, sub-block q of half n taking bit 4n + q of bytes 0..31; the 64 bytes of
// the 2-bit plane; 12 bytes packing sixteen 6-bit scales (gguf_q8_k16.cuh); f16 d; w = d * (scale - 32) * (low + 4 *
// high - 4), the codes centered): half a block per unit. The blocks are in the CUDA layout (gguf_block.cuh: 16-byte
// aligned bodies found from the block's index by grouped_body_at, the scales and d in the group's header), so every
// chunk is one aligned word.
struct MmqQ3K {
  static constexpr int kType = gguf::Q3_K;
  static constexpr int kBlockElems = 128, kBlockBytes = 55, kPairs = 2, kDepth = 1;
  static constexpr bool kUnitScales = true, kMins = false, kSplitLanes = true, kHalfScales = true;
  static constexpr bool kHalfMins = false;
  uint32_t ql[2], hm[2];  // [k]: the lane's bytes 4t.. (k = 0) and 16 + 4t.. (k = 1) of each 32
  uint32_t sc[3];
  uint32_t dw;
  int n;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P body = gguf::grouped_body_at<gguf::Q3_K>(row, u >> 1);
    const P scales = gguf::grouped_field_at<gguf::Q3_K>(row, u >> 1, gguf::kQ3KScales);
    n = u & 1;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      ql[k] = gguf::ld<uint32_t>(body + (32 + 32 * n + 16 * k + 4 * t));
      hm[k] = gguf::ld<uint32_t>(body + (16 * k + 4 * t));
    }
#pragma unroll
    for (int i = 0; i < 3; ++i) sc[i] = gguf::ld<uint32_t>(scales + 4 * i);
    dw = gguf::fetch_f16_a2(gguf::grouped_field_at<gguf::Q3_K>(row, u >> 1, gguf::kQ3KD));
  }
  GGUF_HD void codes(int j, int, uint32_t (&lo)[2], uint32_t (&hi)[2]) const {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint32_t q = ql[k], high = hm[k] >> (4 * n);
      lo[k] = centered_code(q, high, 2 * j);
      hi[k] = centered_code(q, high, 2 * j + 1);
    }
  }
  // centered<3> of plane p's two bits plus the high bit p: the plane to bits 5..6 with bit 7 set, masked and set in
  // one op, then the high bit flipping bit 7.
  GGUF_HD static uint32_t centered_code(uint32_t q, uint32_t high, int p) {
    return and_xor(shift_by(q, 5 - 2 * p), 0x60606060u, 0x80808080u) ^ (shift_by(high, 7 - p) & 0x80808080u);
  }
  GGUF_HD void unit_scales(float& d, float& dmin) const {
    d = gguf::f16_a2(dw) * kCenteredScale<3>, dmin = 0.f;
  }
  GGUF_HD void half_scales(int j, int (&s)[2][2]) const {
    const uint32_t six = ((sc[j] >> (4 * n)) & gguf::kNib) | (((sc[2] >> (4 * n + 2 * j)) & 0x03030303u) << 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i >> 1][i & 1] = static_cast<int>((six >> (8 * i)) & 0xFF) - 32;
  }
};

// Q6_K (210 bytes: ql[128] low nibbles, qh[64] top two bits, 16 int8 scales, f16 d; w = d * sc * (code - 32), one
// scale per 16 elements). A unit is half a block (n = u & 1: elements 128n.., sub-blocks 4n + q for q = 0..3):
// sub-block q's element l takes nibble q >> 1 of ql byte 64n + 32 (q & 1) + l and bits 2q, 2q + 1 of qh byte
// 32n + l, its halves scales 8n + 2q and 8n + 2q + 1; pair j holds q = 2j and 2j + 1, so both read the same
// bytes. The blocks are in the CUDA layout (gguf_block.cuh: 16-byte aligned bodies, found from the block's index by
// grouped_body_at), so every chunk is one aligned word.
struct MmqQ6K {
  static constexpr int kType = gguf::Q6_K;
  static constexpr int kBlockElems = 128, kBlockBytes = 105, kPairs = 2, kDepth = 1;  // bytes: half a block's
  static constexpr bool kUnitScales = true, kMins = false, kSplitLanes = true, kHalfScales = true;
  static constexpr bool kHalfMins = false;
  uint32_t ql[2][2], qh[2];  // [k]: the lane's bytes 4t.. (k = 0) and 16 + 4t.. (k = 1) of each 32
  uint2 sc;
  uint32_t dw;
  template <class P>
  GGUF_HD void fetch(P row, int u, int t) {
    const P body = gguf::grouped_body_at<gguf::Q6_K>(row, u >> 1);
    const int n = u & 1;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      ql[0][k] = gguf::ld<uint32_t>(body + (64 * n + 16 * k + 4 * t));
      ql[1][k] = gguf::ld<uint32_t>(body + (64 * n + 32 + 16 * k + 4 * t));
      qh[k] = gguf::ld<uint32_t>(body + (128 + 32 * n + 16 * k + 4 * t));
    }
    sc = gguf::ld<uint2>(body + (192 + 8 * n));
    dw = gguf::fetch_f16_a2(gguf::grouped_field_at<gguf::Q6_K>(row, u >> 1, gguf::kQ6KD));
  }
  GGUF_HD void codes(int j, int, uint32_t (&lo)[2], uint32_t (&hi)[2]) const {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint32_t l0 = ql[0][k], l1 = ql[1][k], h = qh[k];
      // centered<6> of nibble j plus two high bits: the nibble to bits 2..5 with bit 7 set (one op), then the high
      // bits into 6..7, flipping 7.
      lo[k] = and_xor(shift_by(l0, 2 - 4 * j), 0x3C3C3C3Cu, 0x80808080u) ^ (shift_by(h, 6 - 4 * j) & 0xC0C0C0C0u);
      hi[k] = and_xor(shift_by(l1, 2 - 4 * j), 0x3C3C3C3Cu, 0x80808080u) ^ (shift_by(h, 4 - 4 * j) & 0xC0C0C0C0u);
    }
  }
  GGUF_HD void unit_scales(float& d, float& dmin) const {
    d = gguf::f16_a2(dw) * kCenteredScale<6>, dmin = 0.f;
  }
  // sc[i][h]: the scale of half h of sub-block 2j + i (bytes 4j..4j+3 of the unit's 8 scales).
  GGUF_HD void half_scales(int j, int (&s)[2][2]) const {
    const uint32_t w = j == 0 ? sc.x : sc.y;
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i >> 1][i & 1] = static_cast<int8_t>(w >> (8 * i));
  }
};

}  // namespace candle_vllm::cuda::mmq
