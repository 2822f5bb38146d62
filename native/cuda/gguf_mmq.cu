// Batched decode product on int8 tensor cores for GGUF weights: y[M, N] = x[M, K] @ W[N, K]^T for
// up to 32 tokens, x given as the int8 codes and XBlocks of q8_activation.cuh (the dp4a GEMV's inputs).
//
// Why: the dp4a GEMV decodes every weight once per token, so its integer work grows with M and from about 8 tokens
// it is bound by instruction issue, far below the memory bandwidth. Here a weight is decoded once for all tokens:
// a warp unpacks a 16-row x 32-column tile of codes into the A fragment of mma.m16n8k32 (s8 x s8 -> s32) and
// multiplies it with up to four 8-token B fragments. The tensor cores give each (row, token, 32-element
// sub-block) the exact integer dot product of the codes, scaled in f32 as the dp4a GEMV scales it:
// dx * (a * dot - b * sum(x codes)), w = a * code - b being the sub-block's weights.
//
// A CTA owns 16 weight rows and its 4 warps split K by 256-element blocks (warp w takes blocks w, w + 4, ...),
// each streaming its next block's weights into registers while it multiplies the current one (the first before
// griddepcontrol.wait: weights do not depend on the kernel before); partial sums meet in shared memory and warp
// order is fixed, so results are deterministic and a token's result does not depend on the other tokens.
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

constexpr int kMmqRows = 16, kMmqWarps = 4;

// c = a[16x32] (row, s8) * b[32x8] (col, s8), s32 (PTX fragment layouts of mma.m16n8k32).
__device__ __forceinline__ void mma_s8_16832(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  c[0] = c[1] = c[2] = c[3] = 0;
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One lane's share of a Q4_K block row (144 bytes: d, dmin, 12 bytes of packed 6-bit scales and mins, 128 code
// bytes, sub-blocks 2j and 2j+1 in the low and high nibbles of bytes 16 + 32j ..): bytes 8t..8t+7 of each pair.
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
    const float d = gguf::half_lo(h.x), dmin = gguf::half_hi(h.x);
    uint32_t sc, m;
    gguf::k4_scale_min_pair(h.y, h.z, h.w, j, sc, m);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      a[i] = d * static_cast<float>((sc >> (8 * i)) & 0xFF);
      b[i] = dmin * static_cast<float>((m >> (8 * i)) & 0xFF);
    }
  }
};

template <int Type>
struct MmqOf;
template <>
struct MmqOf<gguf::Q4_K> {
  using type = MmqQ4K;
};

// The activations of one token tile for this lane: B words of token 8i + g, XBlocks of tokens 8i + 2t, 8i + 2t + 1.
struct TokenRows {
  const int8_t* codes;
  const XBlock* blocks[2];
};

// acc (rows g, g + 8 x tokens 2t, 2t + 1 of the tile) += the sub-block at element e: codes a, scales (a, b) per row.
__device__ __forceinline__ void sub_block(float (&acc)[4], const uint32_t (&frag)[4], const float (&a)[2],
                                          const float (&b)[2], const TokenRows& x, int e) {
  const uint2 bw = gguf::ld_x<uint2>(x.codes + e);
  int c[4];
  mma_s8_16832(c, frag, bw.x, bw.y);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint2 raw = gguf::ld_x<uint2>(x.blocks[k] + e / 32);
    const float dx = __uint_as_float(raw.x);
    const float sx = static_cast<float>(static_cast<int16_t>(raw.y & 0xFFFF) + static_cast<int16_t>(raw.y >> 16));
#pragma unroll
    for (int r = 0; r < 2; ++r) acc[2 * r + k] += dx * (a[r] * static_cast<float>(c[2 * r + k]) - b[r] * sx);
  }
}

template <int Type, int T>
__global__ void __launch_bounds__(kMmqWarps * 32) gguf_mmq_kernel(void* __restrict__ y, bool bf16,
                                                                   const int8_t* xq, const XBlock* xb,
                                                                   const uint8_t* __restrict__ w, int M, int N, int K,
                                                                   int64_t row_bytes) {
  using Q = typename MmqOf<Type>::type;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * kMmqRows, blocks = K / Q::kBlockElems;
  const uint8_t* rows[2] = {w + static_cast<int64_t>(min(row0 + g, N - 1)) * row_bytes,
                            w + static_cast<int64_t>(min(row0 + g + 8, N - 1)) * row_bytes};
  TokenRows x[T];
#pragma unroll
  for (int i = 0; i < T; ++i) {
    x[i].codes = xq + static_cast<int64_t>(min(8 * i + g, M - 1)) * K + 8 * t;
#pragma unroll
    for (int k = 0; k < 2; ++k) x[i].blocks[k] = xb + static_cast<int64_t>(min(8 * i + 2 * t + k, M - 1)) * (K / 32);
  }
  float acc[T][4] = {};

  Q next[2];
  int blk = warp;
  if (blk < blocks)
#pragma unroll
    for (int r = 0; r < 2; ++r) next[r].fetch(rows[r] + static_cast<int64_t>(blk) * Q::kBlockBytes, t);
  pdl_wait();  // xq/xb are written by the kernel before
  for (; blk < blocks; blk += kMmqWarps) {
    Q cur[2] = {next[0], next[1]};
    if (blk + kMmqWarps < blocks)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        next[r].fetch(rows[r] + static_cast<int64_t>(blk + kMmqWarps) * Q::kBlockBytes, t);
#pragma unroll
    for (int j = 0; j < Q::kPairs; ++j) {
      uint32_t lo[2][2], hi[2][2];
      float a[2][2], b[2][2];
#pragma unroll
      for (int r = 0; r < 2; ++r) cur[r].pair(j, lo[r], hi[r], a[r], b[r]);
      // A fragment: a0/a2 row g (slots 4t.., 16+4t..), a1/a3 row g + 8.
      const uint32_t flo[4] = {lo[0][0], lo[1][0], lo[0][1], lo[1][1]};
      const uint32_t fhi[4] = {hi[0][0], hi[1][0], hi[0][1], hi[1][1]};
      const float alo[2] = {a[0][0], a[1][0]}, blo[2] = {b[0][0], b[1][0]};
      const float ahi[2] = {a[0][1], a[1][1]}, bhi[2] = {b[0][1], b[1][1]};
      const int e = blk * Q::kBlockElems + 64 * j;
#pragma unroll
      for (int i = 0; i < T; ++i) {
        sub_block(acc[i], flo, alo, blo, x[i], e);
        sub_block(acc[i], fhi, ahi, bhi, x[i], e + 32);
      }
    }
  }
  pdl_launch_dependents();

  __shared__ float red[kMmqWarps][kMmqRows][8 * T + 1];
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) red[warp][g + 8 * (k >> 1)][8 * i + 2 * t + (k & 1)] = acc[i][k];
  __syncthreads();
  for (int o = threadIdx.x; o < kMmqRows * 8 * T; o += kMmqWarps * 32) {
    const int r = o % kMmqRows, m = o / kMmqRows, row = row0 + r;
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

template <int Type>
void launch(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
            cudaStream_t s) {
  using Q = typename MmqOf<Type>::type;
  const int64_t row_bytes = static_cast<int64_t>(K / Q::kBlockElems) * Q::kBlockBytes;
  const dim3 grid(static_cast<unsigned>((N + kMmqRows - 1) / kMmqRows)), block(kMmqWarps * 32);
  const char* what = "gguf_mmq";
  if (M <= 8) launch_pdl(what, gguf_mmq_kernel<Type, 1>, grid, block, 0, s, y, bf16, xq, xb, w, M, N, K, row_bytes);
  else if (M <= 16) launch_pdl(what, gguf_mmq_kernel<Type, 2>, grid, block, 0, s, y, bf16, xq, xb, w, M, N, K, row_bytes);
  else launch_pdl(what, gguf_mmq_kernel<Type, 4>, grid, block, 0, s, y, bf16, xq, xb, w, M, N, K, row_bytes);
}

}  // namespace

bool gguf_mmq_supported(int qtype) { return qtype == gguf::Q4_K; }

void launch_gguf_mmq(void* y, bool bf16, const int8_t* xq, const gguf::XBlock* xb, const uint8_t* w, int M, int N,
                     int K, int qtype, cudaStream_t stream) {
  switch (qtype) {
    case gguf::Q4_K: launch<gguf::Q4_K>(y, bf16, xq, xb, w, M, N, K, stream); break;
    default: throw std::invalid_argument("gguf_mmq: no tensor-core kernel for GGUF type " + std::to_string(qtype));
  }
}

}  // namespace candle_vllm::cuda
