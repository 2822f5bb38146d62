// Paged decode attention (split-KV, GQA on tensor cores, flash-decoding); the pieces' combination is in
// split_kv_reduce.cuh, the KV-cache write in kv_cache_write.cu.
//
// Grid (kv-head group, sequence, piece). A CTA covers heads_per_cta kv heads (each token's cache row of those
// heads streamed as one contiguous run: 2 KB for all 8 of a Llama-3-8B layer, 1 KB in e4m3) with `splits` warps per kv head,
// at most kAttnCtaRow / head_dim warps; small batches take fewer heads per CTA, so more, smaller CTAs fill the
// GPU. K/V stages of splits x kTile tokens go global -> shared through a kStages-deep cp.async pipeline
// (zero-filled past the piece), 16-byte chunks XOR-swizzled by token so the ldmatrix reads are free of bank
// conflicts. Warp w of a kv head takes tile w of every stage: it holds the head's query heads as the 16 rows of
// an mma.m16n8k16 A operand (padded with zero rows), takes scores Q K^T and the update P V on the tensor cores,
// and keeps an online softmax per row in registers (base-2 exponentials, the scale folded in before exp2); at
// the end the splits merge through shared memory. A warp's chain of dependent instructions per tile, not the
// bytes in flight, bounds a small-batch CTA (Nsight Compute), so splitting a head's tiles over warps shortens
// the critical path without more split-KV pieces to reduce.
// Pieces are cut per sequence at run time: the attended span [first, len) is divided into gridDim.z equal
// pieces (whole stages), so a grid sized for the longest context a CUDA graph serves keeps every CTA busy at
// shorter ones. With one piece the CTA writes the normalised output; otherwise each writes (unnormalised out,
// max, sum), combined either by a reduce kernel (launched as a programmatic dependent so its launch overlaps
// the main kernel's tail) or, with reduce counters, by the last CTA of each (sequence, head group) to finish.
// Programmatic dependent launch: the kernel starts while the one before it (the fused RoPE + cache write)
// runs. Before pdl_wait it reads only host-copied inputs (seq_lens, block table) and issues the cp.async of
// its first tiles when they hold only tokens older than the newest (position seq_len - 1, which that kernel
// writes); q, the newest token's tile and every output come after the wait.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/fp8_kv.cuh"
#include "cuda/mma.cuh"
#include "cuda/smem_pipe.cuh"
#include "cuda/paged_attention.h"
#include "cuda/split_kv_reduce.cuh"

namespace candle_vllm::cuda {
namespace {

constexpr int kTile = 16;   // tokens per pipeline stage: the k of the P V mma
constexpr int kStages = 3;  // tiles in shared memory; kStages - 1 in flight while one is computed
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int block_of(int j, int block_size, int block_shift) {
  return block_shift >= 0 ? j >> block_shift : j / block_size;
}

// q is written by the kernel before this one, which may still run when this grid starts (PDL): an ordinary load
// after the wait, never the read-only (.nc) path.
__device__ __forceinline__ uint32_t ld_u32(const void* p) { return __ldca(reinterpret_cast<const unsigned int*>(p)); }

// Calls f(d, x0, y0, x1, y1) for every pair of output channels d, d + 1 a lane holds: (x0, y0) of its row r0,
// (x1, y1) of r1. The P V n-tiles of an e4m3 cache interleave a chunk's channels (fp8_kv.cuh).
template <bool F8, int N, typename F>
__device__ __forceinline__ void for_out_pairs(const float (&o)[N][4], int tig, F&& f) {
  if constexpr (F8) {
#pragma unroll
    for (int c = 0; c < N / 2; ++c) {
      f(16 * c + 4 * tig, o[2 * c][0], o[2 * c + 1][0], o[2 * c][2], o[2 * c + 1][2]);
      f(16 * c + 4 * tig + 2, o[2 * c][1], o[2 * c + 1][1], o[2 * c][3], o[2 * c + 1][3]);
    }
  } else {
#pragma unroll
    for (int n = 0; n < N; ++n) f(n * 8 + tig * 2, o[n][0], o[n][1], o[n][2], o[n][3]);
  }
}

// 16-byte chunks of one token's row in a K/V stage: an e4m3 row pads to whole 128-byte lines, so the XOR swizzle
// (chunk ^ token & 7) stays within it.
__host__ __device__ constexpr int stage_pitch(int row_chunks, bool f8) { return f8 ? (row_chunks + 7) & ~7 : row_chunks; }

// S: warps per kv head (splits), a template argument so the common one-warp form carries no split code. KV: the
// cache element, T or Fp8 (an e4m3 cache: f16 mma on converted fragments, fp8_kv.cuh).
template <typename T, typename KV, int D, int S>
__global__ void __launch_bounds__(kAttnCtaRow / D * 32, 1) paged_decode_kernel(
    T* __restrict__ out, const T* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens, float* __restrict__ part_out,
    float* __restrict__ part_ml, int* __restrict__ counters, int group, int q_heads, int kv_heads, int64_t q_stride,
    int block_size, int block_shift, int max_blocks, int piece_cap, float qscale, float cap_log2,
    float inv_cap, int sliding_window) {
  constexpr bool F8 = !std::is_same_v<KV, T>;
  using M = std::conditional_t<F8, __half, T>;  // the mma operand type
  constexpr int kElems = 16 / sizeof(KV);  // cache values per 16-byte chunk
  constexpr int kHeadChunks = D / kElems;  // 16-byte chunks of one kv head's row
  constexpr int kTokStep = 32 * kElems / D;  // tokens one pass of a kv head's worth of copying threads covers
  constexpr int kKSteps = D / 16;          // k steps of Q K^T, and pairs of 8-wide column tiles of P V
  extern __shared__ __align__(128) unsigned char smem[];

  constexpr int splits = S;
  const int heads = (blockDim.x >> 5) / splits;  // kv heads of the CTA; warp = split * heads + head
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = S == 1 ? 0 : warp / heads, head = S == 1 ? warp : warp % heads;
  const int seq = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
  const int kvh0 = blockIdx.x * heads, kvh = kvh0 + head;
  const bool active = kvh < kv_heads;
  const int row_chunks = heads * kHeadChunks;  // chunks of one token's row
  const int pitch = stage_pitch(row_chunks, F8);
  constexpr int unit = kTile * splits;         // tokens per stage: one tile per split
  const int stage_bytes = unit * pitch * 16;
  int32_t* tbl = reinterpret_cast<int32_t*>(smem + kStages * 2 * stage_bytes);
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment row group / thread in group
  const int r0 = gid, r1 = gid + 8;           // this lane's query rows (heads of the group)

  const int ctx = seq_lens[seq];
  const int first = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
  const int span = ctx - first;
  const int plen = piece_len(span, parts, piece_cap, unit);
  const int t0 = first + part * plen, t1 = min(t0 + plen, ctx);
  if (t1 <= t0) {  // past the context: the reduce reads only non-empty pieces
    pdl_wait();
    // An empty context: piece 0 writes zeros when no reduce kernel follows to do it.
    if (part == 0 && (parts == 1 || counters != nullptr)) {
      const size_t head0 = static_cast<size_t>(seq) * q_heads + static_cast<size_t>(kvh0) * group;
      const int n = min(heads, kv_heads - kvh0) * group * D;
      for (int e = tid; e < n; e += blockDim.x) out[head0 * D + e] = from_f32<T>(0.f);
    }
    return;
  }

  const int b0 = block_of(t0, block_size, block_shift);
  const int nblk = block_of(t1 - 1, block_size, block_shift) - b0 + 1;
  const int32_t* table = block_tables + static_cast<size_t>(seq) * max_blocks + b0;
  for (int i = tid; i < nblk; i += blockDim.x) tbl[i] = table[i];
  __syncthreads();

  // Copy roles: this thread moves chunk c of tokens ts, ts + kTokStep * splits, ... of every stage.
  const int c = tid % row_chunks, ts = tid / row_chunks, tok_step = kTokStep * splits;
  const bool chunk_ok = kvh0 + c / kHeadChunks < kv_heads;
  const size_t row = static_cast<size_t>(kv_heads) * D;
  const size_t col = static_cast<size_t>(kvh0) * D + c * kElems;
  const uint32_t sbase = smem_addr(smem);
  auto load_stage = [&](int step, int stage) {
    const int j0 = t0 + step * unit;
    const uint32_t ks = sbase + stage * 2 * stage_bytes, vs = ks + stage_bytes;
#pragma unroll
    for (int i = 0; i < kTile / kTokStep; ++i) {
      const int t = ts + i * tok_step, j = j0 + t;
      const bool ok = chunk_ok && j < t1;
      size_t src = 0;
      if (ok) {
        const int blk = tbl[block_of(j, block_size, block_shift) - b0];
        const int off = block_shift >= 0 ? (j & (block_size - 1)) : j % block_size;
        src = (static_cast<size_t>(blk) * block_size + off) * row + col;
      }
      const uint32_t dst = static_cast<uint32_t>(t * pitch + (c ^ (t & 7))) * 16;
      cp_async16(ks + dst, kc + src, ok);
      cp_async16(vs + dst, vc + src, ok);
    }
  };

  const int nsteps = (t1 - t0 + unit - 1) / unit;
  // Leading stages wholly before the newest token are final before the previous kernel ends: issue them now.
  const int old_steps = t1 < ctx ? nsteps : (ctx - 1 - t0) / unit;
  const int early = min(min(nsteps, kStages - 1), old_steps);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s == early) pdl_wait();
    if (s < nsteps) load_stage(s, s);
    cp_async_commit();
  }
  if (early == kStages - 1) pdl_wait();

  // A fragments of Q (rows past the group are zero): the previous kernel wrote q, so after the wait. With an
  // e4m3 cache, as f16 with each k step's channels in the order of the K fragments (fp8_kv.cuh).
  uint32_t qa[kKSteps][4];
  {
    const T* qb = q + static_cast<size_t>(seq) * q_stride + static_cast<size_t>(kvh) * group * D + tig * (F8 ? 4 : 2);
    const bool v0 = active && r0 < group, v1 = active && r1 < group;
    constexpr int kHi = F8 ? 2 : 8;  // offset of a2/a3's channels from a0/a1's
    auto word = [&](const T* p) { if constexpr (F8) return to_f16x2<T>(ld_u32(p)); else return ld_u32(p); };
#pragma unroll
    for (int k = 0; k < kKSteps; ++k) {
      qa[k][0] = v0 ? word(qb + r0 * D + k * 16) : 0u;
      qa[k][1] = v1 ? word(qb + r1 * D + k * 16) : 0u;
      qa[k][2] = v0 ? word(qb + r0 * D + k * 16 + kHi) : 0u;
      qa[k][3] = v1 ? word(qb + r1 * D + k * 16 + kHi) : 0u;
    }
  }

  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  float o[2 * kKSteps][4];
#pragma unroll
  for (int n = 0; n < 2 * kKSteps; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  // ldmatrix row addresses in this warp's tile (rows split * kTile ..; a multiple of 8 leaves the swizzle as is):
  // K as x4 {tokens 0-7, 8-15} x {d, d+8}; V transposed as {d, d+8} x {tokens 0-7, 8-15}.
  const int head_col = head * kHeadChunks;
  const int kt = ((lane >> 4) << 3) + (lane & 7), kcol = head_col + ((lane >> 3) & 1);
  const int vt = (((lane >> 3) & 1) << 3) + (lane & 7), vcol = head_col + (lane >> 4);
  const int krow = split * kTile + kt, vrow = split * kTile + vt;

  for (int i = 0; i < nsteps; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage i landed for every thread; the stage of step i - 1 is free again
    if (i + kStages - 1 < nsteps) load_stage(i + kStages - 1, (i + kStages - 1) % kStages);
    cp_async_commit();
    if (!active) continue;
    const uint32_t ks = sbase + (i % kStages) * 2 * stage_bytes, vs = ks + stage_bytes;
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    if constexpr (F8) {
      // One x4: tokens 0-7 / 8-15 x chunks (k steps) k, k + 1.
#pragma unroll
      for (int k = 0; k < kKSteps; k += 2) {
        uint32_t w[4], b0, b1;
        ldmatrix_x4(w, ks + static_cast<uint32_t>(krow * pitch + ((kcol + k) ^ (kt & 7))) * 16);
        e4m3_k_frag(w[0], b0, b1);
        mma_16816<M>(s[0], qa[k], b0, b1);
        e4m3_k_frag(w[2], b0, b1);
        mma_16816<M>(s[1], qa[k], b0, b1);
        e4m3_k_frag(w[1], b0, b1);
        mma_16816<M>(s[0], qa[k + 1], b0, b1);
        e4m3_k_frag(w[3], b0, b1);
        mma_16816<M>(s[1], qa[k + 1], b0, b1);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kKSteps; ++k) {
        uint32_t b[4];
        ldmatrix_x4(b, ks + static_cast<uint32_t>(krow * pitch + ((kcol + 2 * k) ^ (kt & 7))) * 16);
        mma_16816<M>(s[0], qa[k], b[0], b[1]);
        mma_16816<M>(s[1], qa[k], b[2], b[3]);
      }
    }
    // s[n][e]: row r0 (e < 2) or r1, token n * 8 + tig * 2 + (e & 1) of the tile.
    const int jb = t0 + i * unit + split * kTile + tig * 2;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[n][e] * qscale;
        if (cap_log2 > 0.f) v = cap_log2 * tanhf(v * inv_cap);
        s[n][e] = jb + n * 8 + (e & 1) < t1 ? v : -INFINITY;
      }
    float mx0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
    float mx1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
    }
    mx0 = fmaxf(mx0, m0);
    mx1 = fmaxf(mx1, m1);
    const float base0 = exp_base(mx0), base1 = exp_base(mx1);
    const float a0 = exp2f(m0 - base0), a1 = exp2f(m1 - base1);
    m0 = mx0;
    m1 = mx1;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = exp2f(s[n][0] - base0);
      s[n][1] = exp2f(s[n][1] - base0);
      s[n][2] = exp2f(s[n][2] - base1);
      s[n][3] = exp2f(s[n][3] - base1);
    }
    l0 = l0 * a0 + (s[0][0] + s[0][1]) + (s[1][0] + s[1][1]);  // this lane's share; the row's 4 lanes add up at the end
    l1 = l1 * a1 + (s[0][2] + s[0][3]) + (s[1][2] + s[1][3]);
#pragma unroll
    for (int n = 0; n < 2 * kKSteps; ++n) {
      o[n][0] *= a0;
      o[n][1] *= a0;
      o[n][2] *= a1;
      o[n][3] *= a1;
    }
    // The score fragments are the A fragment of P V as they stand (rows r0/r1, tokens tig*2 and 8 + tig*2).
    const uint32_t pa[4] = {pack2<M>(s[0][0], s[0][1]), pack2<M>(s[0][2], s[0][3]), pack2<M>(s[1][0], s[1][1]),
                            pack2<M>(s[1][2], s[1][3])};
    if constexpr (F8) {
      // One x4 .trans: tokens 0-7 / 8-15 x chunks c, c + 1, each chunk the even and odd n-tiles 2c, 2c + 1.
#pragma unroll
      for (int c = 0; c < kHeadChunks; c += 2) {
        uint32_t w[4], e0, o0, e1, o1;
        ldmatrix_x4_trans(w, vs + static_cast<uint32_t>(vrow * pitch + ((vcol + c) ^ (vt & 7))) * 16);
        e4m3_v_frag(w[0], e0, o0);
        e4m3_v_frag(w[1], e1, o1);
        mma_16816<M>(o[2 * c], pa, e0, e1);
        mma_16816<M>(o[2 * c + 1], pa, o0, o1);
        e4m3_v_frag(w[2], e0, o0);
        e4m3_v_frag(w[3], e1, o1);
        mma_16816<M>(o[2 * c + 2], pa, e0, e1);
        mma_16816<M>(o[2 * c + 3], pa, o0, o1);
      }
    } else {
#pragma unroll
      for (int n = 0; n < kKSteps; ++n) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vs + static_cast<uint32_t>(vrow * pitch + ((vcol + 2 * n) ^ (vt & 7))) * 16);
        mma_16816<M>(o[2 * n], pa, b[0], b[1]);
        mma_16816<M>(o[2 * n + 1], pa, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();
  // The next kernel (reduce or o_proj GEMV) may start launching now; it waits for this grid's completion.
  pdl_launch_dependents();

#pragma unroll
  for (int x = 1; x < 4; x <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, x);
    l1 += __shfl_xor_sync(0xffffffffu, l1, x);
  }
  if constexpr (splits > 1) {
    // The other splits of a kv head hand their (max, sum, rows) to split 0 through the stage buffers, each
    // lane's fragment values at its own lane slot (no layout change), and split 0 folds them into its own.
    constexpr int kVals = 4 * 2 * kKSteps + 4;
    float* xchg = reinterpret_cast<float*>(smem) + static_cast<size_t>(head) * (splits - 1) * kVals * 32;
    __syncthreads();  // every warp is done reading the stages
    if (split > 0) {
      float* mine = xchg + (split - 1) * kVals * 32 + lane;
#pragma unroll
      for (int n = 0; n < 2 * kKSteps; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) mine[(4 * n + e) * 32] = o[n][e];
      mine[(kVals - 4) * 32] = m0;
      mine[(kVals - 3) * 32] = m1;
      mine[(kVals - 2) * 32] = l0;
      mine[(kVals - 1) * 32] = l1;
    }
    __syncthreads();
    if (split == 0) {
      for (int w = 1; w < splits; ++w) {
        const float* theirs = xchg + (w - 1) * kVals * 32 + lane;
        const float tm0 = theirs[(kVals - 4) * 32], tm1 = theirs[(kVals - 3) * 32];
        const float n0 = fmaxf(m0, tm0), n1 = fmaxf(m1, tm1);
        const float base0 = exp_base(n0), base1 = exp_base(n1);
        const float a0 = exp2f(m0 - base0), b0 = exp2f(tm0 - base0);
        const float a1 = exp2f(m1 - base1), b1 = exp2f(tm1 - base1);
        m0 = n0;
        m1 = n1;
        l0 = l0 * a0 + theirs[(kVals - 2) * 32] * b0;
        l1 = l1 * a1 + theirs[(kVals - 1) * 32] * b1;
#pragma unroll
        for (int n = 0; n < 2 * kKSteps; ++n) {
          o[n][0] = o[n][0] * a0 + theirs[(4 * n) * 32] * b0;
          o[n][1] = o[n][1] * a0 + theirs[(4 * n + 1) * 32] * b0;
          o[n][2] = o[n][2] * a1 + theirs[(4 * n + 2) * 32] * b1;
          o[n][3] = o[n][3] * a1 + theirs[(4 * n + 3) * 32] * b1;
        }
      }
    }
  }
  const size_t h = static_cast<size_t>(seq) * q_heads + static_cast<size_t>(kvh) * group;  // warp's first head
  const bool w0 = active && split == 0 && r0 < group, w1 = active && split == 0 && r1 < group;
  if (parts == 1) {
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;
    for_out_pairs<F8>(o, tig, [&](int d, float x0, float y0, float x1, float y1) {
      if (w0) store2<T>(out + (h + r0) * D + d, x0 * inv0, y0 * inv0);
      if (w1) store2<T>(out + (h + r1) * D + d, x1 * inv1, y1 * inv1);
    });
    return;
  }
  const size_t ml_l = static_cast<size_t>(gridDim.y) * q_heads;  // offset of the sums in part_ml
  for_out_pairs<F8>(o, tig, [&](int d, float x0, float y0, float x1, float y1) {
    if (w0) *reinterpret_cast<float2*>(part_out + ((h + r0) * parts + part) * D + d) = make_float2(x0, y0);
    if (w1) *reinterpret_cast<float2*>(part_out + ((h + r1) * parts + part) * D + d) = make_float2(x1, y1);
  });
  if (tig == 0) {
    if (w0) {
      part_ml[(h + r0) * parts + part] = m0;
      part_ml[(ml_l + h + r0) * parts + part] = l0;
    }
    if (w1) {
      part_ml[(h + r1) * parts + part] = m1;
      part_ml[(ml_l + h + r1) * parts + part] = l1;
    }
  }
  if (counters == nullptr) return;

  // Last CTA reduces: each CTA publishes its partials and counts itself in; the one that completes the count
  // of non-empty pieces (those before `used`) combines them and re-arms the counter for the next call.
  __threadfence();
  __syncthreads();  // every thread's partials are visible device-wide before the count says so
  const int used = min(parts, (span + plen - 1) / plen);
  int* counter = counters + static_cast<size_t>(seq) * gridDim.x + blockIdx.x;
  int last = 0;
  if (tid == 0) {
    last = atomicAdd(counter, 1) == used - 1;
    if (last) *counter = 0;
  }
  if (!__syncthreads_or(last)) return;
  __threadfence();
  const size_t head0 = static_cast<size_t>(seq) * q_heads + static_cast<size_t>(kvh0) * group;
  // The stage buffers are free (every warp passed the last barrier after its final stage): the reduce's rows.
  reduce_pieces<T, D>(out, part_out, part_ml, head0, min(heads, kv_heads - kvh0) * group, ml_l, parts, used,
                      reinterpret_cast<PieceState*>(smem));
}

// Dynamic shared memory a decode CTA needs: kStages K/V stages (a tile per split of each kv head) plus its
// piece's block-table slice. The splits' final exchange and the fused reduce reuse the stages.
inline size_t decode_smem_bytes(int64_t heads, int64_t splits, int64_t head_dim, int64_t elem_bytes,
                                int64_t piece_cap, int64_t block_size) {
  const int64_t table = (piece_cap + block_size - 1) / block_size + 1;
  const int64_t pitch = stage_pitch(static_cast<int>(heads * head_dim * elem_bytes / 16), elem_bytes == 1);
  return static_cast<size_t>(kStages * 2 * kTile * splits * pitch * 16 + table * 4);
}

// Raises the decode kernel's dynamic shared-memory limit to the device's opt-in maximum and asks for the
// largest shared-memory carveout (several small CTAs share an SM; the kernel never reads through L1), once per
// kernel instance and device, and returns that maximum. Runs outside stream work, so it is safe during
// CUDA-graph capture. (Keyed by <T, KV, D, S>, not by the kernel's function type, which every head_dim shares.)
template <typename T, typename KV, int D, int S>
int decode_smem_optin() {
  static int limit[64] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "paged_attention_decode: cudaGetDevice");
  if (dev >= 64) throw std::runtime_error("paged_attention_decode: device index above 63");
  if (limit[dev] == 0) {
    int optin = 0;
    check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
               "paged_attention_decode: shared-memory limit");
    check_cuda(cudaFuncSetAttribute(paged_decode_kernel<T, KV, D, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    optin),
               "paged_attention_decode: raise the shared-memory limit");
    check_cuda(cudaFuncSetAttribute(paged_decode_kernel<T, KV, D, S>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared),
               "paged_attention_decode: shared-memory carveout");
    limit[dev] = optin;
  }
  return limit[dev];
}

template <typename T, typename KV, int D>
void launch_decode(T* out, const T* q, const KV* kc, const KV* vc, const int32_t* tables, const int32_t* lens,
                   float* part_out, float* part_ml, int32_t* counters, int64_t num_seqs, int64_t q_heads,
                   int64_t kv_heads, int64_t q_stride, int64_t block_size, int64_t max_blocks, int64_t partition_size,
                   int64_t parts, int64_t heads_per_cta, int64_t splits, float scale, float softcap, int64_t window,
                   cudaStream_t stream) {
  const int64_t group = q_heads / kv_heads;
  const int64_t heads = std::min<int64_t>(kv_heads, heads_per_cta);
  const int64_t head_groups = (kv_heads + heads - 1) / heads;
  const int64_t unit = kTile * splits;
  const int64_t cap = (partition_size + unit - 1) / unit * unit;
  int shift = -1;  // block_size as a shift when it is a power of two
  if ((block_size & (block_size - 1)) == 0)
    for (shift = 0; (int64_t{1} << shift) < block_size; ++shift) {}
  // Scores are kept in base-2 units: the scale (and log2 e) multiplies the raw dot products, or the soft cap.
  const float qscale = softcap > 0.f ? scale : scale * kLog2e;
  const float cap_log2 = softcap > 0.f ? softcap * kLog2e : 0.f;
  const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
  const size_t smem = decode_smem_bytes(heads, splits, D, sizeof(KV), cap, block_size);
  const int optin = splits == 1   ? decode_smem_optin<T, KV, D, 1>()
                    : splits == 2 ? decode_smem_optin<T, KV, D, 2>()
                                  : decode_smem_optin<T, KV, D, 4>();
  if (smem > static_cast<size_t>(optin))
    throw std::invalid_argument("paged_attention_decode: heads_per_cta x head_dim, partition_size / block_size too "
                                "large (the CTA's K/V stages and block-table slice do not fit shared memory); use "
                                "fewer heads per CTA or a smaller partition_size");
  const dim3 grid(static_cast<unsigned>(head_groups), static_cast<unsigned>(num_seqs), static_cast<unsigned>(parts));
  auto kernel = splits == 1   ? paged_decode_kernel<T, KV, D, 1>
                : splits == 2 ? paged_decode_kernel<T, KV, D, 2>
                              : paged_decode_kernel<T, KV, D, 4>;
  launch_pdl("paged_attention_decode", kernel, grid, dim3(static_cast<unsigned>(heads * splits * 32)), smem, stream,
             out, q, kc, vc, tables, lens, part_out, part_ml, parts > 1 ? counters : nullptr, static_cast<int>(group),
             static_cast<int>(q_heads), static_cast<int>(kv_heads), q_stride, static_cast<int>(block_size), shift,
             static_cast<int>(max_blocks), static_cast<int>(cap), qscale, cap_log2, inv_cap, static_cast<int>(window));
  if (parts > 1 && counters == nullptr) {
    launch_pdl("paged_attention_decode reduce", paged_decode_reduce_kernel<T, D>,
               dim3(static_cast<unsigned>(q_heads), static_cast<unsigned>(num_seqs)), dim3(kReduceThreads), 0, stream,
               out, static_cast<const float*>(part_out), static_cast<const float*>(part_ml), lens,
               static_cast<int>(num_seqs), static_cast<int>(q_heads), static_cast<int>(parts), static_cast<int>(cap),
               static_cast<int>(unit), static_cast<int>(window));
  }
}

}  // namespace

void paged_attention_decode(void* out, const void* q, const void* key_cache, const void* value_cache,
                            const int32_t* block_tables, const int32_t* seq_lens, float* partial_out,
                            float* partial_ml, int32_t* reduce_counters, int64_t num_seqs, int64_t q_heads,
                            int64_t kv_heads, int64_t head_dim, int64_t q_stride, int64_t block_size,
                            int64_t max_blocks, int64_t partition_size, int64_t num_partitions,
                            int64_t heads_per_cta, int64_t splits, float scale, float softcap, int64_t sliding_window,
                            DType dtype, DType cache_dtype, std::uintptr_t stream) {
  if (kv_heads < 1 || q_heads % kv_heads != 0 || q_heads / kv_heads > kAttnMaxGroup)
    throw std::invalid_argument("paged_attention_decode: q_heads must be a multiple of kv_heads, at most 16x");
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    throw std::invalid_argument("paged_attention_decode: head_dim must be 64, 128 or 256");
  if (splits != 1 && splits != 2 && splits != 4)
    throw std::invalid_argument("paged_attention_decode: splits (warps per kv head) must be 1, 2 or 4");
  if (heads_per_cta < 1 || std::min(heads_per_cta, kv_heads) * splits > kAttnCtaRow / head_dim)
    throw std::invalid_argument("paged_attention_decode: heads_per_cta x splits (warps per CTA) must be 1 .. "
                                "1024 / head_dim");
  if (block_size < 1) throw std::invalid_argument("paged_attention_decode: block_size must be positive");
  if (partition_size < 1 || num_partitions < 1) throw std::invalid_argument("paged_attention_decode: bad partitioning");
  if (num_partitions > 1 && (partial_out == nullptr || partial_ml == nullptr))
    throw std::invalid_argument("paged_attention_decode: split-KV needs partial buffers");
  if (cache_dtype != dtype && cache_dtype != DType::F8E4M3)
    throw std::invalid_argument("paged_attention_decode: the cache must hold q's dtype or e4m3");
  if (num_seqs == 0) return;
  dispatch_float<false>(dtype, "paged_attention_decode", [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto kv_tag, auto d_const) {
      using KV = decltype(kv_tag);
      launch_decode<T, KV, decltype(d_const)::value>(
          static_cast<T*>(out), static_cast<const T*>(q), static_cast<const KV*>(key_cache),
          static_cast<const KV*>(value_cache), block_tables, seq_lens, partial_out, partial_ml, reduce_counters,
          num_seqs, q_heads, kv_heads, q_stride, block_size, max_blocks, partition_size, num_partitions,
          heads_per_cta, splits, scale, softcap, sliding_window, as_stream(stream));
    };
    auto by_dim = [&](auto kv_tag) {
      if (head_dim == 64) run(kv_tag, std::integral_constant<int, 64>{});
      else if (head_dim == 128) run(kv_tag, std::integral_constant<int, 128>{});
      else run(kv_tag, std::integral_constant<int, 256>{});
    };
    if (cache_dtype == DType::F8E4M3) by_dim(Fp8{});
    else by_dim(T{});
  });
}

}  // namespace candle_vllm::cuda
