// Batched decode product on int8 tensor cores for GGUF weights: y[M, N] = x[M, K] @ W[N, K]^T for
// up to 32 tokens, x given as the int8 codes and XBlocks of q8_activation.cuh (the dp4a GEMV's inputs).
//
// Why: the dp4a GEMV decodes every weight once per token, so its integer work grows with M and from about 8 tokens
// it is bound by instruction issue, far below the memory bandwidth. Here a weight is decoded once for all tokens:
// a warp unpacks a 16-row x 32-column tile of codes into the A fragment of mma.m16n8k32 (s8 x s8 -> s32) and
// multiplies it with up to four 8-token B fragments. The tensor cores give each (row, token, 32-element
// sub-block) the exact integer dot product of the codes, scaled in f32 as dx * (a * dot) - b * (dx * sum(x codes)),
// w = a * code - b being the sub-block's weights (the dp4a GEMV rounds dx * (a * dot - b * sum): same value,
// other roundings).
//
// A CTA owns 16 or 32 weight rows (one or two 16-row tiles per warp: an activation load then serves 32 rows) and its
// 4 warps split K by 256-element blocks (warp w takes blocks w, w + 4, ...), each streaming its next block's weights
// into registers while it multiplies the current one (the first before griddepcontrol.wait: weights do not depend
// on the kernel before); partial sums meet in shared memory and warp order is fixed, so results are deterministic
// and a token's result does not depend on the other tokens or on the tiling.
//
// The k order inside an mma is free as long as A and B agree: lane t of a quad (threadID_in_group) holds k slots
// 4t..4t+3 and 16+4t..16+4t+3; they are given the sub-block's elements 8t..8t+7, so every lane reads 8
// contiguous code bytes of its row and 8 contiguous activation codes of its token.
#include "cuda/common.cuh"
#include "cuda/gguf_mmq.h"
#include "cuda/gguf_q8_kquants.cuh"

namespace candle_vllm::cuda {
namespace {

using gguf::XBlock;

constexpr int kMmqWarps = 4;

// c = a[16x32] (row, s8) * b[32x8] (col, s8), s32 (PTX fragment layouts of mma.m16n8k32).
__device__ __forceinline__ void mma_s8_16832(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  c[0] = c[1] = c[2] = c[3] = 0;
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

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

// One lane's share of a Q4_K block row (144 bytes: the header, then 128 code bytes whose pair j holds sub-blocks 2j
// and 2j+1 in the low and high nibbles of bytes 16 + 32j ..): bytes 8t..8t+7 of each pair.
struct MmqQ4K {
  static constexpr int kBlockElems = 256, kBlockBytes = 144, kPairs = 4;
  uint2 q[kPairs];
  uint4 h;
  __device__ void fetch(const uint8_t* blk, int t) {
    h = gguf::ld<uint4>(blk);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) q[j] = gguf::ld<uint2>(blk + 16 + 32 * j + 8 * t);
  }
  // Pair j: the codes of sub-blocks 2j (lo) and 2j+1 (hi) as two A words each, and w = a * code - b per sub-block.
  __device__ void pair(int j, uint32_t (&lo)[2], uint32_t (&hi)[2], float (&a)[2], float (&b)[2]) const {
    lo[0] = q[j].x & gguf::kNib, lo[1] = q[j].y & gguf::kNib;
    hi[0] = (q[j].x >> 4) & gguf::kNib, hi[1] = (q[j].y >> 4) & gguf::kNib;
    k4_pair_scales(h, j, a, b);
  }
};

// Q5_K (176 bytes: the header, 32 bytes whose byte i holds the fifth bit of element i of sub-block s in bit s, then
// the low nibbles as Q4_K holds its codes): Q4_K's lane share plus the lane's 8 bytes of fifth bits.
struct MmqQ5K {
  static constexpr int kBlockElems = 256, kBlockBytes = 176, kPairs = 4;
  uint2 q[kPairs], e;
  uint4 h;
  __device__ void fetch(const uint8_t* blk, int t) {
    h = gguf::ld<uint4>(blk);
    e = gguf::ld<uint2>(blk + 16 + 8 * t);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) q[j] = gguf::ld<uint2>(blk + 48 + 32 * j + 8 * t);
  }
  __device__ void pair(int j, uint32_t (&lo)[2], uint32_t (&hi)[2], float (&a)[2], float (&b)[2]) const {
    const uint32_t qs[2] = {q[j].x, q[j].y}, qh[2] = {e.x, e.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      lo[k] = (qs[k] & gguf::kNib) | (((qh[k] >> (2 * j)) & 0x01010101u) << 4);
      hi[k] = ((qs[k] >> 4) & gguf::kNib) | (((qh[k] >> (2 * j + 1)) & 0x01010101u) << 4);
    }
    k4_pair_scales(h, j, a, b);
  }
};

template <int Type>
struct MmqOf;
template <>
struct MmqOf<gguf::Q4_K> {
  using type = MmqQ4K;
};
template <>
struct MmqOf<gguf::Q5_K> {
  using type = MmqQ5K;
};

// The activations of one token tile for this lane: B words of token 8i + g, XBlocks of tokens 8i + 2t, 8i + 2t + 1.
struct TokenRows {
  const int8_t* codes;
  const XBlock* blocks[2];
};

// (dx, dx * sum of codes) of sub-blocks s and s + 1 of one token, from their two adjacent XBlocks (one 16-byte load).
struct XScales {
  float d[2], s[2];
  __device__ void load(const XBlock* p) {
    const uint4 raw = gguf::ld_x<uint4>(p);
    const uint32_t words[2][2] = {{raw.x, raw.y}, {raw.z, raw.w}};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      d[h] = __uint_as_float(words[h][0]);
      const int sum = static_cast<int16_t>(words[h][1] & 0xFFFF) + static_cast<int16_t>(words[h][1] >> 16);
      s[h] = d[h] * static_cast<float>(sum);
    }
  }
};

// A CTA owns 16 * MT weight rows (MT m-tiles per warp, so each activation load serves 16 * MT rows); its 4 warps split
// K by 256-element blocks (warp w takes blocks w, w + 4, ...), each streaming its next block's weights into registers
// while it multiplies the current one. T: 8-token tiles.
template <int Type, int MT, int T>
__global__ void __launch_bounds__(kMmqWarps * 32) gguf_mmq_kernel(void* __restrict__ y, bool bf16,
                                                                   const int8_t* xq, const XBlock* xb,
                                                                   const uint8_t* __restrict__ w, int M, int N, int K,
                                                                   int64_t row_bytes) {
  using Q = typename MmqOf<Type>::type;
  constexpr int kRows = 16 * MT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * kRows, blocks = K / Q::kBlockElems;
  const uint8_t* rows[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) rows[mt][r] = w + static_cast<int64_t>(min(row0 + 16 * mt + g + 8 * r, N - 1)) * row_bytes;
  TokenRows x[T];
#pragma unroll
  for (int i = 0; i < T; ++i) {
    x[i].codes = xq + static_cast<int64_t>(min(8 * i + g, M - 1)) * K + 8 * t;
#pragma unroll
    for (int k = 0; k < 2; ++k) x[i].blocks[k] = xb + static_cast<int64_t>(min(8 * i + 2 * t + k, M - 1)) * (K / 32);
  }
  float acc[MT][T][4] = {};

  Q next[MT][2];
  auto fetch = [&](int b) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) next[mt][r].fetch(rows[mt][r] + static_cast<int64_t>(b) * Q::kBlockBytes, t);
  };
  int blk = warp;
  if (blk < blocks) fetch(blk);
  pdl_wait();  // xq/xb are written by the kernel before
  for (; blk < blocks; blk += kMmqWarps) {
    Q cur[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) cur[mt][0] = next[mt][0], cur[mt][1] = next[mt][1];
    if (blk + kMmqWarps < blocks) fetch(blk + kMmqWarps);
#pragma unroll
    for (int j = 0; j < Q::kPairs; ++j) {
      // Per m-tile: rows g and g + 8, the codes of sub-blocks 2j (lo) and 2j + 1 (hi) and their (a, b).
      uint32_t lo[MT][2][2], hi[MT][2][2];
      float a[MT][2][2], b[MT][2][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) cur[mt][r].pair(j, lo[mt][r], hi[mt][r], a[mt][r], b[mt][r]);
      const int e = blk * Q::kBlockElems + 64 * j;
#pragma unroll
      for (int i = 0; i < T; ++i) {
        XScales xs[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) xs[k].load(x[i].blocks[k] + e / 32);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint2 bw = gguf::ld_x<uint2>(x[i].codes + e + 32 * h);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            // A fragment: a0/a2 row g (slots 4t.., 16+4t..), a1/a3 row g + 8.
            const uint32_t(&q)[2][2] = h ? hi[mt] : lo[mt];
            const uint32_t frag[4] = {q[0][0], q[1][0], q[0][1], q[1][1]};
            int c[4];
            mma_s8_16832(c, frag, bw.x, bw.y);
#pragma unroll
            for (int k = 0; k < 2; ++k)
#pragma unroll
              for (int r = 0; r < 2; ++r)
                acc[mt][i][2 * r + k] +=
                    xs[k].d[h] * (a[mt][r][h] * static_cast<float>(c[2 * r + k])) - b[mt][r][h] * xs[k].s[h];
          }
        }
      }
    }
  }
  pdl_launch_dependents();

  __shared__ float red[kMmqWarps][kRows][8 * T + 1];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) red[warp][16 * mt + g + 8 * (k >> 1)][8 * i + 2 * t + (k & 1)] = acc[mt][i][k];
  __syncthreads();
  for (int o = threadIdx.x; o < kRows * 8 * T; o += kMmqWarps * 32) {
    const int r = o % kRows, m = o / kRows, row = row0 + r;
    float v = red[0][r][m];
#pragma unroll
    for (int i = 1; i < kMmqWarps; ++i) v += red[i][r][m];
    if (row < N && m < M) {
      const int64_t at = static_cast<int64_t>(m) * N + row;
      if (bf16) static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(v);
      else static_cast<__half*>(y)[at] = __float2half_rn(v);
    }
  }
}

template <int Type, int MT, int T>
void launch_tiles(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
                  cudaStream_t s) {
  using Q = typename MmqOf<Type>::type;
  const int64_t row_bytes = static_cast<int64_t>(K / Q::kBlockElems) * Q::kBlockBytes;
  const dim3 grid(static_cast<unsigned>((N + 16 * MT - 1) / (16 * MT))), block(kMmqWarps * 32);
  launch_pdl("gguf_mmq", gguf_mmq_kernel<Type, MT, T>, grid, block, 0, s, y, bf16, xq, xb, w, M, N, K, row_bytes);
}

template <int Type, int MT>
void launch_rows(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
                 cudaStream_t s) {
  if (M <= 8) launch_tiles<Type, MT, 1>(y, bf16, xq, xb, w, M, N, K, s);
  else if (M <= 16) launch_tiles<Type, MT, 2>(y, bf16, xq, xb, w, M, N, K, s);
  else launch_tiles<Type, MT, 4>(y, bf16, xq, xb, w, M, N, K, s);
}

// Two row tiles per CTA up to 16 tokens; above, where that still leaves a CTA for every SM (the 2 x 4-tile kernel
// spills at 255 registers). Measured on the H200 (bench_quant_cuda.py --kernels mmq --mmq-row-tiles 1 2, q4k; us,
// 1 -> 2 tiles): 16 tokens 6144x4096 17.5 -> 15.8, 4096x4096 16.0 -> 14.9, 28672x4096 77.8 -> 58.7, 4096x14336
// 52.0 -> 43.4; 32 tokens 44.2 -> 31.0, 24.2 -> 30.3, 148.8 -> 115.5, 78.0 -> 98.9.
int default_row_tiles(int M, int N) { return M <= 16 || (N + 31) / 32 >= device_sm_count() ? 2 : 1; }

template <int Type>
void launch(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
            int row_tiles, cudaStream_t s) {
  switch (row_tiles != 0 ? row_tiles : default_row_tiles(M, N)) {
    case 1: launch_rows<Type, 1>(y, bf16, xq, xb, w, M, N, K, s); break;
    case 2: launch_rows<Type, 2>(y, bf16, xq, xb, w, M, N, K, s); break;
    default: throw std::invalid_argument("gguf_mmq: row_tiles must be 0 (the default rule), 1 or 2");
  }
}

}  // namespace

bool gguf_mmq_supported(int qtype) { return qtype == gguf::Q4_K || qtype == gguf::Q5_K; }

void launch_gguf_mmq(void* y, bool bf16, const int8_t* xq, const gguf::XBlock* xb, const uint8_t* w, int M, int N,
                     int K, int qtype, int row_tiles, cudaStream_t stream) {
  switch (qtype) {
    case gguf::Q4_K: launch<gguf::Q4_K>(y, bf16, xq, xb, w, M, N, K, row_tiles, stream); break;
    case gguf::Q5_K: launch<gguf::Q5_K>(y, bf16, xq, xb, w, M, N, K, row_tiles, stream); break;
    default: throw std::invalid_argument("gguf_mmq: no tensor-core kernel for GGUF type " + std::to_string(qtype));
  }
}

}  // namespace candle_vllm::cuda
