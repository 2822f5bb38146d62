// Tile loaders of the int8 tensor-core GGUF product for Q4_K and Q5_K (contract: gguf_mmq_tile.cuh): one
// 256-element block per unit, its 16-byte header decoded per pair of sub-blocks.
#pragma once
#include "cuda/gguf_mmq_tile.cuh"
#include "cuda/gguf_q8_kquants.cuh"

namespace candle_vllm::cuda::mmq {

// w = a * code - b for Q4_K / Q5_K sub-blocks 2j and 2j+1, from the block's first 16 bytes h (d, dmin, 12 bytes of
// packed 6-bit scales and mins).
__device__ __forceinline__ void k4_pair_scales(const uint4& h, int j, float (&a)[2], float (&b)[2]) {
  const float d = gguf::half_lo(h.x), dmin = gguf::half_hi(h.x);
  uint32_t sc, m;
  gguf::k4_scale_min_pair(h.y, h.z, h.w, j, sc, m);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    a[i] = d * static_cast<float>((sc >> (8 * i)) & 0xFF);
    b[i] = dmin * static_cast<float>((m >> (8 * i)) & 0xFF);
  }
}

// Q4_K (144 bytes: the header, then 128 code bytes whose pair j holds sub-blocks 2j and 2j+1 in the low and high
// nibbles of bytes 16 + 32j ..): bytes 8t..8t+7 of each pair.
struct MmqQ4K {
  static constexpr int kBlockElems = 256, kBlockBytes = 144, kPairs = 4;
  static constexpr int kDepth = 1;
  static constexpr bool kMins = true, kSplitLanes = false;
  uint2 q[kPairs];
  uint4 h;
  __device__ void fetch(const uint8_t* blk, int t) {
    h = gguf::ld<uint4>(blk);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) q[j] = gguf::ld<uint2>(blk + 16 + 32 * j + 8 * t);
  }
  __device__ void pair(int j, int, uint32_t (&lo)[2], uint32_t (&hi)[2], float (&a)[2], float (&b)[2]) const {
    lo[0] = q[j].x & gguf::kNib, lo[1] = q[j].y & gguf::kNib;
    hi[0] = (q[j].x >> 4) & gguf::kNib, hi[1] = (q[j].y >> 4) & gguf::kNib;
    k4_pair_scales(h, j, a, b);
  }
};

// Q5_K (176 bytes: the header, 32 bytes whose byte i holds the fifth bit of element i of sub-block s in bit s, then
// the low nibbles as Q4_K holds its codes): Q4_K's lane share plus the lane's 8 bytes of fifth bits.
struct MmqQ5K {
  static constexpr int kBlockElems = 256, kBlockBytes = 176, kPairs = 4;
  static constexpr int kDepth = 1;
  static constexpr bool kMins = true, kSplitLanes = false;
  uint2 q[kPairs], e;
  uint4 h;
  __device__ void fetch(const uint8_t* blk, int t) {
    h = gguf::ld<uint4>(blk);
    e = gguf::ld<uint2>(blk + 16 + 8 * t);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) q[j] = gguf::ld<uint2>(blk + 48 + 32 * j + 8 * t);
  }
  __device__ void pair(int j, int, uint32_t (&lo)[2], uint32_t (&hi)[2], float (&a)[2], float (&b)[2]) const {
    const uint32_t qs[2] = {q[j].x, q[j].y}, qh[2] = {e.x, e.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      lo[k] = (qs[k] & gguf::kNib) | (((qh[k] >> (2 * j)) & 0x01010101u) << 4);
      hi[k] = ((qs[k] >> 4) & gguf::kNib) | (((qh[k] >> (2 * j + 1)) & 0x01010101u) << 4);
    }
    k4_pair_scales(h, j, a, b);
  }
};

template <>
struct MmqOf<gguf::Q4_K> {
  using type = MmqQ4K;
};
template <>
struct MmqOf<gguf::Q5_K> {
  using type = MmqQ5K;
};

}  // namespace candle_vllm::cuda::mmq
