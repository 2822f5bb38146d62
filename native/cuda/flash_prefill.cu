// Flash prefill attention over the paged KV cache (FlashAttention-2 style, mma.sync: sm_80/89/90).
//
// Grid (query head, query tile, sequence); query tiles are taken longest-context first so the causal tail is
// short. A CTA of W warps owns 16*W query rows of one head; each warp owns 16 rows. K/V tiles of BN tokens are
// read through the block table into shared memory with cp.async, the next tile in flight while the current one
// is used (double buffering). S = Q K^T and O += P V run on mma.m16n8k16 (bf16/f16 in, f32 accumulate), with
// operands fetched by ldmatrix from an XOR-swizzled layout (16-byte chunk c of row r sits at c ^ (r & 7), so
// the 8 rows an ldmatrix reads hit 8 distinct bank groups). The softmax is online in base 2 with the scale
// folded into the exponent; S stays in registers and becomes the A operand of P V directly (the C layout of two
// 8-column tiles is the A layout of one 16-deep step). Tiles above a warp's diagonal are skipped, and only
// tiles crossing the diagonal or the sliding window's edge compute a mask. Keys past the needed range are
// zero-filled, so a stale cache slot can never inject NaN into P V.
//
// e4m3 cache (KV = Fp8, q/out still f16/bf16): K/V tiles hold the cached bytes as copied (a 16-byte chunk is 16
// values, so the tiles are half the size; D = 64 rows of 4 chunks swizzle as swz explains), and both products
// run as f16 mma with f32 accumulation whatever T is
// (e4m3 -> f16 is exact; q and P are rounded to f16). The operands come from ldmatrix on the e4m3 tile as
// cuda/fp8_kv.cuh describes: a K chunk is one 16-deep k-step whose channels the B fragment lists in the order
// e4m3_q_channel, so Q is staged (plain loads, converted to f16) with each chunk's channels in that order; a
// transposed V chunk gives the B fragments of two 8-wide n-tiles (the chunk's even and odd channels), so the
// accumulator n-tile 2c + p holds channels 16c + 2n + p, stored back in natural order.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/flash_prefill.h"
#include "cuda/fp8_kv.cuh"
#include "cuda/mma.cuh"

namespace candle_vllm::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, or 16 zero bytes when !pred (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Two f32 as one 32-bit word of T (x in the low half: the lower column of an mma operand).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  uint32_t w;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    memcpy(&w, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(x, y);
    memcpy(&w, &h, 4);
  }
  return w;
}

// Element offset of 16-byte chunk c of row r in a swizzled tile of D-wide rows of VALS values per chunk (8 for
// f16/bf16, 16 for e4m3). Rows of >= 8 chunks put chunk c at c ^ (r & 7). e4m3 rows of D = 64 are 4 chunks (two
// rows per 128 bytes): chunk c goes to c ^ ((r >> 1) & 3), so the 8 rows of one ldmatrix phase, (r & 1) picking
// the half of the 128 bytes and (r >> 1) & 3 the chunk within it, still cover the 8 16-byte bank groups.
template <int D, int VALS = 8>
__device__ __forceinline__ int swz(int r, int c) {
  constexpr int kRowChunks = D / VALS;
  static_assert(kRowChunks == 4 || (kRowChunks >= 8 && kRowChunks % 8 == 0), "swz: 4 or a multiple of 8 chunks");
  if constexpr (kRowChunks >= 8) return r * D + (c ^ (r & 7)) * VALS;
  else return r * D + (c ^ ((r >> 1) & 3)) * VALS;
}

// The value a running max is subtracted from: 0 while nothing was seen, so exp2(-inf - base) stays 0, not NaN.
__device__ __forceinline__ float exp_base(float m) { return m == -INFINITY ? 0.f : m; }

struct Params {
  void* out;
  const void* q;
  const void* kc;
  const void* vc;
  const int32_t* block_tables;
  const int32_t* qsl;
  const int32_t* seq_lens;
  int q_heads, group, q_stride, out_stride, kv_row, block_size, max_blocks, window;
  float scale_log2, softcap, softcap_inv;
  bool skip_single;
};

// T: q/out dtype; KV: cache element type, T or Fp8 (e4m3).
template <typename T, typename KV, int D, int W, int MR, int BN>
struct Tile {
  static constexpr bool kFp8 = std::is_same_v<KV, Fp8>;
  static_assert(kFp8 || std::is_same_v<KV, T>, "the cache is of q's dtype or e4m3");
  using M = std::conditional_t<kFp8, __half, T>;  // mma operand type: the Q tile and P
  static constexpr int kThreads = 32 * W;
  static constexpr int kWarpRows = 16 * MR;  // a warp's query rows: MR stacked 16-row mma tiles
  static constexpr int kBM = kWarpRows * W;
  static constexpr int kChunks = D / 8;  // 16-byte chunks of a Q/out row (K/V rows: D / 16 when e4m3)
  static constexpr bool kQInRegs = MR == 1 && D <= 128;
  static constexpr int kSmemBytes =
      kBM * D * static_cast<int>(sizeof(T)) + 4 * BN * D * static_cast<int>(sizeof(KV));
  static_assert(sizeof(M) == sizeof(T), "the Q tile doubles as the output staging tile");
  static_assert(!kFp8 || BN % 32 == 0, "e4m3 K fragments are read 4 n-tiles (32 keys) at a time");
};

// K and V rows [kv0, kv0 + BN) of one kv head into shared memory; rows >= kv_end are zero-filled.
template <typename KV, int D, int THREADS, int BN>
__device__ __forceinline__ void load_kv(KV* sk, KV* sv, const KV* kc, const KV* vc, const int32_t* table, int kv0,
                                        int kv_end, const Params& p, int kv_head) {
  constexpr int kVals = 16 / static_cast<int>(sizeof(KV)), kChunks = D / kVals;
#pragma unroll
  for (int i = threadIdx.x; i < BN * kChunks; i += THREADS) {
    const int r = i / kChunks, c = i % kChunks, tok = kv0 + r;
    const bool ok = tok < kv_end;
    size_t off = 0;
    if (ok) {
      const int blk = __ldg(table + tok / p.block_size);
      off = (static_cast<size_t>(blk) * p.block_size + tok % p.block_size) * p.kv_row + kv_head * D + c * kVals;
    }
    cp_async16(sk + swz<D, kVals>(r, c), kc + off, ok);
    cp_async16(sv + swz<D, kVals>(r, c), vc + off, ok);
  }
}

// e4m3 cache: the Q tile as f16, each 16-channel chunk permuted so that position i holds channel
// e4m3_q_channel(i) (0, 1, 4, 5, 8, 9, 12, 13 | 2, 3, 6, 7, 10, 11, 14, 15), the k order of the K fragments;
// rows >= rows are zeros. Words w[j] hold channels 2j, 2j + 1: the even words form the first f16 chunk, the odd
// ones the second.
template <typename T, int D, int THREADS, int BM>
__device__ __forceinline__ void stage_q_f16(__half* sq, const T* q, int rows, int q_stride) {
  constexpr int kChunks = D / 16;
#pragma unroll
  for (int i = threadIdx.x; i < BM * kChunks; i += THREADS) {
    const int r = i / kChunks, c = i % kChunks;
    uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
    if (r < rows) {
      const uint4* src = reinterpret_cast<const uint4*>(q + static_cast<size_t>(r) * q_stride + c * 16);
      lo = __ldg(src);
      hi = __ldg(src + 1);
    }
    *reinterpret_cast<uint4*>(sq + swz<D>(r, 2 * c)) =
        make_uint4(to_f16x2<T>(lo.x), to_f16x2<T>(lo.z), to_f16x2<T>(hi.x), to_f16x2<T>(hi.z));
    *reinterpret_cast<uint4*>(sq + swz<D>(r, 2 * c + 1)) =
        make_uint4(to_f16x2<T>(lo.y), to_f16x2<T>(lo.w), to_f16x2<T>(hi.y), to_f16x2<T>(hi.w));
  }
}

template <typename T, typename KV, int D, int W, int MR, int BN>
__global__ void __launch_bounds__(32 * W) flash_prefill_kernel(const Params p) {
  using C = Tile<T, KV, D, W, MR, BN>;
  using M = typename C::M;
  constexpr int BM = C::kBM;
  const int head = blockIdx.x, seq = blockIdx.z;
  const int q_start = p.qsl[seq], q_len = p.qsl[seq + 1] - q_start;
  if (q_len == 0 || (p.skip_single && q_len == 1)) return;
  const int n_tiles = (q_len + BM - 1) / BM;
  if (static_cast<int>(blockIdx.y) >= n_tiles) return;
  const int m0 = (n_tiles - 1 - blockIdx.y) * BM;  // longest contexts first
  const int ctx = p.seq_lens[seq];
  const int rows = min(BM, q_len - m0);
  const int qp_first = ctx - q_len + m0, qp_last = qp_first + rows - 1;
  const int kv_end = qp_last + 1;
  const int kv_begin = p.window > 0 ? max(0, qp_first - p.window + 1) : 0;
  const int n_begin = kv_begin / BN, n_end = (kv_end + BN - 1) / BN;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  M* sq = reinterpret_cast<M*>(smem_raw);
  KV* sk = reinterpret_cast<KV*>(sq + BM * D);  // two stages of K, then two of V
  KV* sv = sk + 2 * BN * D;
  const T* q = static_cast<const T*>(p.q);
  const KV* kc = static_cast<const KV*>(p.kc);
  const KV* vc = static_cast<const KV*>(p.vc);
  const int kv_head = head / p.group;
  const int32_t* table = p.block_tables + static_cast<size_t>(seq) * p.max_blocks;

  if constexpr (!C::kFp8) {
#pragma unroll
    for (int i = threadIdx.x; i < BM * C::kChunks; i += C::kThreads) {
      const int r = i / C::kChunks, c = i % C::kChunks;
      const bool ok = r < rows;
      const T* src = ok ? q + static_cast<size_t>(q_start + m0 + r) * p.q_stride + head * D + c * 8 : q;
      cp_async16(sq + swz<D>(r, c), src, ok);
    }
  }
  load_kv<KV, D, C::kThreads, BN>(sk, sv, kc, vc, table, n_begin * BN, kv_end, p, kv_head);
  cp_async_commit();
  // e4m3: Q converted while the first K/V tile is in flight; the loop's first barrier publishes it.
  if constexpr (C::kFp8)
    stage_q_f16<T, D, C::kThreads, BM>(sq, q + static_cast<size_t>(q_start + m0) * p.q_stride + head * D, rows,
                                       p.q_stride);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wrow = warp * C::kWarpRows;
  // Absolute position of this thread's row lane/4 of 16-row tile 0 (tile mr adds 16 * mr, the second row 8).
  const int qp_lane = qp_first + wrow + (lane >> 2);
  const int w_first = qp_first + wrow, w_last = min(qp_first + wrow + C::kWarpRows - 1, qp_last);
  const bool warp_live = wrow < rows;

  uint32_t qf[C::kQInRegs ? D / 16 : 1][4];
  float o[MR][D / 8][4];
  float m_run[MR][2], l_run[MR][2];
#pragma unroll
  for (int mr = 0; mr < MR; ++mr) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mr][i][0] = o[mr][i][1] = o[mr][i][2] = o[mr][i][3] = 0.f;
    m_run[mr][0] = m_run[mr][1] = -INFINITY;
    l_run[mr][0] = l_run[mr][1] = 0.f;
  }

  for (int n = n_begin; n < n_end; ++n) {
    const int stage = (n - n_begin) & 1;
    if (n + 1 < n_end) {
      load_kv<KV, D, C::kThreads, BN>(sk + (stage ^ 1) * BN * D, sv + (stage ^ 1) * BN * D, kc, vc, table,
                                       (n + 1) * BN, kv_end, p, kv_head);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (C::kQInRegs) {
      if (n == n_begin) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], sq + swz<D>(wrow + (lane & 15), kk * 2 + (lane >> 4)));
      }
    }
    const int kv0 = n * BN;
    const KV* k_s = sk + stage * BN * D;
    const KV* v_s = sv + stage * BN * D;
    // Warp-uniform: skip tiles wholly above this warp's diagonal or wholly before its window.
    const bool live = warp_live && kv0 <= w_last && (p.window <= 0 || kv0 + BN - 1 > w_first - p.window);
    if (live) {
      float s[MR][BN / 8][4];
#pragma unroll
      for (int mr = 0; mr < MR; ++mr)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) s[mr][i][0] = s[mr][i][1] = s[mr][i][2] = s[mr][i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MR][4];
#pragma unroll
        for (int mr = 0; mr < MR; ++mr) {
          if constexpr (C::kQInRegs) {
#pragma unroll
            for (int j = 0; j < 4; ++j) a[mr][j] = qf[kk][j];
          } else {
            ldmatrix_x4(a[mr], sq + swz<D>(wrow + mr * 16 + (lane & 15), kk * 2 + (lane >> 4)));
          }
        }
        if constexpr (C::kFp8) {
          // Chunk kk is k-step kk: matrix j of one x4 is keys 8j..8j+7 of a 32-key group, the n-tile 4 nq + j.
#pragma unroll
          for (int nq = 0; nq < BN / 32; ++nq) {
            uint32_t b[4];
            ldmatrix_x4(b, k_s + swz<D, 16>(nq * 32 + (lane >> 3) * 8 + (lane & 7), kk));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              uint32_t b0, b1;
              e4m3_k_frag(b[j], b0, b1);
#pragma unroll
              for (int mr = 0; mr < MR; ++mr) mma_16816<M>(s[mr][4 * nq + j], a[mr], b0, b1);
            }
          }
        } else {
#pragma unroll
          for (int np = 0; np < BN / 16; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, k_s + swz<D>(np * 16 + (lane >> 4) * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
            for (int mr = 0; mr < MR; ++mr) {
              mma_16816<T>(s[mr][2 * np], a[mr], b[0], b[1]);
              mma_16816<T>(s[mr][2 * np + 1], a[mr], b[2], b[3]);
            }
          }
        }
      }
      const bool masked = kv0 + BN - 1 > w_first || (p.window > 0 && kv0 <= w_last - p.window);
#pragma unroll
      for (int mr = 0; mr < MR; ++mr) {
        // Scores to the log2 domain (soft-capped first when asked), masked on diagonal / window-edge tiles.
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float x = s[mr][i][j];
            if (p.softcap > 0.f) x = p.softcap * tanhf(x * p.softcap_inv) * kLog2e;
            else x *= p.scale_log2;
            if (masked) {
              const int kp = kv0 + i * 8 + (lane & 3) * 2 + (j & 1);
              const int qp = qp_lane + mr * 16 + (j < 2 ? 0 : 8);
              if (kp > qp || (p.window > 0 && kp <= qp - p.window)) x = -INFINITY;
            }
            s[mr][i][j] = x;
          }
        float mx0 = m_run[mr][0], mx1 = m_run[mr][1];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          mx0 = fmaxf(mx0, fmaxf(s[mr][i][0], s[mr][i][1]));
          mx1 = fmaxf(mx1, fmaxf(s[mr][i][2], s[mr][i][3]));
        }
#pragma unroll
        for (int o_ = 1; o_ <= 2; o_ <<= 1) {
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o_));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o_));
        }
        const float b0 = exp_base(mx0), b1 = exp_base(mx1);
        const float alpha0 = exp2f(m_run[mr][0] - b0), alpha1 = exp2f(m_run[mr][1] - b1);
        m_run[mr][0] = mx0;
        m_run[mr][1] = mx1;
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          s[mr][i][0] = exp2f(s[mr][i][0] - b0);
          s[mr][i][1] = exp2f(s[mr][i][1] - b0);
          s[mr][i][2] = exp2f(s[mr][i][2] - b1);
          s[mr][i][3] = exp2f(s[mr][i][3] - b1);
          sum0 += s[mr][i][0] + s[mr][i][1];
          sum1 += s[mr][i][2] + s[mr][i][3];
        }
        l_run[mr][0] = l_run[mr][0] * alpha0 + sum0;
        l_run[mr][1] = l_run[mr][1] * alpha1 + sum1;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          o[mr][i][0] *= alpha0;
          o[mr][i][1] *= alpha0;
          o[mr][i][2] *= alpha1;
          o[mr][i][3] *= alpha1;
        }
      }
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[MR][4];
#pragma unroll
        for (int mr = 0; mr < MR; ++mr) {
          a[mr][0] = pack2<M>(s[mr][2 * kk][0], s[mr][2 * kk][1]);
          a[mr][1] = pack2<M>(s[mr][2 * kk][2], s[mr][2 * kk][3]);
          a[mr][2] = pack2<M>(s[mr][2 * kk + 1][0], s[mr][2 * kk + 1][1]);
          a[mr][3] = pack2<M>(s[mr][2 * kk + 1][2], s[mr][2 * kk + 1][3]);
        }
        if constexpr (C::kFp8) {
          // Same addressing in chunk units: b[2h] / b[2h + 1] are keys 0-7 / 8-15 of chunk 2 dq + h, each word
          // the two n-tiles of that chunk (even and odd channels), accumulator tiles 4 dq + 2h and 4 dq + 2h + 1.
#pragma unroll
          for (int dq = 0; dq < D / 32; ++dq) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, v_s + swz<D, 16>(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), dq * 2 + (lane >> 4)));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              uint32_t e0, o0, e1, o1;
              e4m3_v_frag(b[2 * h], e0, o0);
              e4m3_v_frag(b[2 * h + 1], e1, o1);
#pragma unroll
              for (int mr = 0; mr < MR; ++mr) {
                mma_16816<M>(o[mr][4 * dq + 2 * h], a[mr], e0, e1);
                mma_16816<M>(o[mr][4 * dq + 2 * h + 1], a[mr], o0, o1);
              }
            }
          }
        } else {
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, v_s + swz<D>(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), dp * 2 + (lane >> 4)));
#pragma unroll
            for (int mr = 0; mr < MR; ++mr) {
              mma_16816<T>(o[mr][2 * dp], a[mr], b[0], b[1]);
              mma_16816<T>(o[mr][2 * dp + 1], a[mr], b[2], b[3]);
            }
          }
        }
      }
    }
    __syncthreads();  // the stage read here is refilled next iteration
  }

  // Normalise and stage the warp's rows in its own rows of the Q tile, then store 16-byte pieces.
  T* so = reinterpret_cast<T*>(smem_raw);
#pragma unroll
  for (int mr = 0; mr < MR; ++mr) {
    float l0 = l_run[mr][0], l1 = l_run[mr][1];
#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, o_);
      l1 += __shfl_xor_sync(0xffffffffu, l1, o_);
    }
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    const int r0 = wrow + mr * 16 + (lane >> 2);
    if constexpr (C::kFp8) {
      // Tiles 2c and 2c + 1 hold channels 16c + 4t + {0, 2} and 16c + 4t + {1, 3} (t = lane & 3): interleaved,
      // four consecutive channels, half of 8-value chunk 2c + t / 2.
      const int t = lane & 3;
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        const float(&ev)[4] = o[mr][2 * c];
        const float(&od)[4] = o[mr][2 * c + 1];
        *reinterpret_cast<uint2*>(so + swz<D>(r0, 2 * c + (t >> 1)) + (t & 1) * 4) =
            make_uint2(pack2<T>(ev[0] * inv0, od[0] * inv0), pack2<T>(ev[1] * inv0, od[1] * inv0));
        *reinterpret_cast<uint2*>(so + swz<D>(r0 + 8, 2 * c + (t >> 1)) + (t & 1) * 4) =
            make_uint2(pack2<T>(ev[2] * inv1, od[2] * inv1), pack2<T>(ev[3] * inv1, od[3] * inv1));
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        *reinterpret_cast<uint32_t*>(so + swz<D>(r0, i) + (lane & 3) * 2) =
            pack2<T>(o[mr][i][0] * inv0, o[mr][i][1] * inv0);
        *reinterpret_cast<uint32_t*>(so + swz<D>(r0 + 8, i) + (lane & 3) * 2) =
            pack2<T>(o[mr][i][2] * inv1, o[mr][i][3] * inv1);
      }
    }
  }
  __syncwarp();
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = lane; i < C::kWarpRows * C::kChunks; i += 32) {
    const int r = i / C::kChunks, c = i % C::kChunks;
    if (wrow + r < rows) {
      *reinterpret_cast<uint4*>(out + static_cast<size_t>(q_start + m0 + wrow + r) * p.out_stride + head * D + c * 8) =
          *reinterpret_cast<const uint4*>(so + swz<D>(wrow + r, c));
    }
  }
}

template <typename T, typename KV, int D, int W, int MR, int BN>
void launch(const Params& p, int64_t num_seqs, int64_t max_query_len, cudaStream_t stream) {
  using C = Tile<T, KV, D, W, MR, BN>;
  auto kernel = flash_prefill_kernel<T, KV, D, W, MR, BN>;
  // The limit is per function and device; set once per device (outside any graph capture: the first call of a
  // process runs eagerly).
  static bool configured[kMaxDevices] = {};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "flash_prefill: current device");
  if (device >= kMaxDevices) throw std::invalid_argument("flash_prefill: device index above 63");
  if (!configured[device]) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes),
               "flash_prefill: shared-memory limit");
    configured[device] = true;
  }
  const dim3 grid(p.q_heads, (max_query_len + C::kBM - 1) / C::kBM, num_seqs);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  check_launch("flash_prefill");
}

// The instantiated (head_dim, block_m, warp_rows, block_n) combinations, the same for both cache types.
template <typename T, typename KV>
void launch_config(const Params& p, int64_t head_dim, int64_t block_m, int64_t warp_rows, int64_t block_n,
                   int64_t num_seqs, int64_t max_query_len, cudaStream_t s) {
  // (block_m, warp_rows, block_n): 128 query rows as 8 warps x 16 or 4 warps x 32, or 64 rows as 4 x 16.
  const int64_t cfg = (block_m * 100 + warp_rows) * 1000 + block_n;
  if (head_dim == 64 && cfg == 12816064) launch<T, KV, 64, 8, 1, 64>(p, num_seqs, max_query_len, s);
  else if (head_dim == 64 && cfg == 12832064) launch<T, KV, 64, 4, 2, 64>(p, num_seqs, max_query_len, s);
  else if (head_dim == 64 && cfg == 6416064) launch<T, KV, 64, 4, 1, 64>(p, num_seqs, max_query_len, s);
  else if (head_dim == 128 && cfg == 12816064) launch<T, KV, 128, 8, 1, 64>(p, num_seqs, max_query_len, s);
  else if (head_dim == 128 && cfg == 12832064) launch<T, KV, 128, 4, 2, 64>(p, num_seqs, max_query_len, s);
  else if (head_dim == 128 && cfg == 12832032) launch<T, KV, 128, 4, 2, 32>(p, num_seqs, max_query_len, s);
  else if (head_dim == 128 && cfg == 6416064) launch<T, KV, 128, 4, 1, 64>(p, num_seqs, max_query_len, s);
  else if (head_dim == 256 && cfg == 6416032) launch<T, KV, 256, 4, 1, 32>(p, num_seqs, max_query_len, s);
  else
    throw std::invalid_argument(
        "flash_prefill: unsupported (head_dim, block_m, warp_rows, block_n); see kernel_configs in "
        "pyengine/ops/cuda_prefill.py");
}

}  // namespace

void flash_prefill(void* out, const void* q, const void* key_cache, const void* value_cache,
                   const int32_t* block_tables, const int32_t* query_start_loc, const int32_t* seq_lens,
                   int64_t num_seqs, int64_t max_query_len, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                   int64_t q_stride, int64_t block_size, int64_t max_blocks, float scale, float softcap,
                   int64_t sliding_window, int64_t block_m, int64_t warp_rows, int64_t block_n,
                   bool skip_single_token, DType dtype, DType cache_dtype, std::uintptr_t stream) {
  const bool fp8 = cache_dtype == DType::F8E4M3;
  if (!fp8 && cache_dtype != dtype)
    throw std::invalid_argument("flash_prefill: the cache dtype must be q's dtype or e4m3 (F8E4M3)");
  if (num_seqs <= 0 || max_query_len <= 0) return;
  if (kv_heads <= 0 || q_heads % kv_heads != 0) throw std::invalid_argument("flash_prefill: q_heads % kv_heads != 0");
  if (num_seqs > 65535 || (max_query_len + 63) / 64 > 65535)
    throw std::invalid_argument("flash_prefill: at most 65535 sequences and 4M query rows per sequence");
  if (!aligned16(q, key_cache, value_cache, out) || q_stride % 8 != 0)
    throw std::invalid_argument("flash_prefill: q, out and the cache must be 16-byte aligned, q_stride % 8 == 0");
  Params p{out, q, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
           static_cast<int>(q_heads), static_cast<int>(q_heads / kv_heads), static_cast<int>(q_stride),
           static_cast<int>(q_heads * head_dim), static_cast<int>(kv_heads * head_dim), static_cast<int>(block_size),
           static_cast<int>(max_blocks), static_cast<int>(sliding_window > 0 ? sliding_window : 0),
           scale * kLog2e, softcap > 0.f ? softcap : 0.f, softcap > 0.f ? scale / softcap : 0.f, skip_single_token};
  const cudaStream_t s = as_stream(stream);
  dispatch_float<false>(dtype, "flash_prefill", [&](auto tag) {
    using T = decltype(tag);
    if (fp8) launch_config<T, Fp8>(p, head_dim, block_m, warp_rows, block_n, num_seqs, max_query_len, s);
    else launch_config<T, T>(p, head_dim, block_m, warp_rows, block_n, num_seqs, max_query_len, s);
  });
}

}  // namespace candle_vllm::cuda
