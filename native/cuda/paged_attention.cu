// Paged decode attention (split-KV, GQA-aware, flash-decoding) and the KV-cache write.
//
// Grid (kv_head x head slice, sequence, partition). A CTA serves up to kMaxSlice query heads of one kv head
// (a whole GQA group up to 8 heads), so each K/V byte of its partition is read once for all of them.
// The CTA first copies its piece of the block table to shared memory, so no K/V load waits on a table load.
// Lanes split head_dim in 16-byte pieces (D/8 lanes per token, a "lane group"); a warp walks chunks of
// U tokens per lane group with the next chunk's loads in flight while it computes on the current one (keys
// are refetched once the scores are taken, values once they are accumulated), and keeps an online softmax
// per lane group (running max, sum and output in registers, base-2 exponentials with the scale folded into
// q). At the end lane groups merge by shuffles, warps through shared memory.
// With one partition the CTA writes the normalised output; otherwise it writes (unnormalised out, max, sum)
// and a reduce kernel rescales and combines the partitions.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/paged_attention.h"

namespace candle_vllm::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

// Two packed 16-bit floats of a 32-bit word as f32 (element 0 in the low half).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t w);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t w) {
  __half2 h;
  memcpy(&h, &w, sizeof(h));
  return __half22float2(h);
}

template <typename T>
__device__ __forceinline__ void unpack8(float (&dst)[8], const uint4& r) {
  const float2 a = unpack2<T>(r.x), b = unpack2<T>(r.y), c = unpack2<T>(r.z), d = unpack2<T>(r.w);
  dst[0] = a.x; dst[1] = a.y; dst[2] = b.x; dst[3] = b.y; dst[4] = c.x; dst[5] = c.y; dst[6] = d.x; dst[7] = d.y;
}

// The value a running max is subtracted from: 0 while nothing was seen, so exp2(-inf - base) stays 0, not NaN.
__device__ __forceinline__ float exp_base(float m) { return m == -INFINITY ? 0.f : m; }

// Blocks of the table one CTA may touch: a piece of partition_size tokens can straddle one extra block.
inline int64_t table_slice_len(int64_t partition_size, int64_t block_size) {
  return (partition_size + block_size - 1) / block_size + 1;
}

__device__ __forceinline__ int block_of(int j, int block_size, int block_shift) {
  return block_shift >= 0 ? j >> block_shift : j / block_size;
}

// The 16-byte slices of one lane's U tokens c + u * TPW + tg (zeros past t1, so they weigh nothing).
template <typename T, int U, int TPW>
__device__ __forceinline__ void load_rows(uint4 (&dst)[U], const T* __restrict__ cache, const int32_t* tbl, int b0,
                                          int c, int t1, int tg, int block_size, int block_shift, size_t row,
                                          size_t lane_off) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int j = c + u * TPW + tg;
    if (j < t1) {
      const int blk = tbl[block_of(j, block_size, block_shift) - b0];
      const int off = block_shift >= 0 ? (j & (block_size - 1)) : j % block_size;
      dst[u] = __ldg(reinterpret_cast<const uint4*>(cache + (static_cast<size_t>(blk) * block_size + off) * row + lane_off));
    } else {
      dst[u] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

template <typename T, int D, int MAXG, int U>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(
    T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens, float* __restrict__ part_out,
    float* __restrict__ part_ml, int group, int slices, int q_heads, int kv_heads, int64_t q_stride, int block_size,
    int block_shift, int max_blocks, int partition_size, float qscale, float cap_log2, float inv_cap,
    int sliding_window) {
  constexpr int kLanes = D / 8;          // lanes per token
  constexpr int kTpw = 32 / kLanes;      // tokens side by side in one warp load
  constexpr int kChunk = kTpw * U;       // tokens per warp iteration
  __shared__ float red[MAXG * D];        // output rows summed over warps
  __shared__ float wstat[2][kWarps][MAXG];  // per warp max, sum
  __shared__ float fin[2][MAXG];            // CTA max, sum
  extern __shared__ int32_t tbl[];          // this piece's block ids, from block b0 on

  const int kvh = blockIdx.x / slices, slice = blockIdx.x % slices;
  const int seq = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tg = lane / kLanes, sub = lane % kLanes;
  const int nh = min(MAXG, group - slice * MAXG);  // query heads of this CTA
  const int ctx = seq_lens[seq];
  const int first = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
  const int t0 = max(part * partition_size, first), t1 = min((part + 1) * partition_size, ctx);
  const size_t head0 = static_cast<size_t>(seq) * q_heads + kvh * group + slice * MAXG;
  const size_t ml_l = static_cast<size_t>(gridDim.y) * q_heads;  // offset of the sums in part_ml

  if (t1 <= t0) {  // empty piece (past the context, or before the window): contributes nothing
    if (parts > 1) {
      for (int g = threadIdx.x; g < nh; g += kThreads) {
        part_ml[(head0 + g) * parts + part] = -INFINITY;
        part_ml[(ml_l + head0 + g) * parts + part] = 0.f;
      }
    } else {
      for (int e = threadIdx.x; e < nh * D; e += kThreads) out[head0 * D + e] = from_f32<T>(0.f);
    }
    return;
  }

  float qr[MAXG][8];
  const T* qbase = q + static_cast<size_t>(seq) * q_stride + (static_cast<size_t>(kvh) * group + slice * MAXG) * D + sub * 8;
#pragma unroll
  for (int g = 0; g < MAXG; ++g) {
    if (g < nh) {
      unpack8<T>(qr[g], *reinterpret_cast<const uint4*>(qbase + static_cast<size_t>(g) * D));
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[g][e] *= qscale;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[g][e] = 0.f;
    }
  }

  float m[MAXG], l[MAXG], acc[MAXG][8];
#pragma unroll
  for (int g = 0; g < MAXG; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }

  const int b0 = block_of(t0, block_size, block_shift);
  const int nblk = block_of(t1 - 1, block_size, block_shift) - b0 + 1;
  const int32_t* table = block_tables + static_cast<size_t>(seq) * max_blocks + b0;
  for (int i = threadIdx.x; i < nblk; i += kThreads) tbl[i] = table[i];
  __syncthreads();

  const size_t row = static_cast<size_t>(kv_heads) * D;  // elements per cache slot
  const size_t lane_off = static_cast<size_t>(kvh) * D + sub * 8;
  constexpr int kStride = kWarps * kChunk;
  int c0 = t0 + warp * kChunk;
  uint4 kr[U], vr[U];
  load_rows<T, U, kTpw>(kr, kc, tbl, b0, c0, t1, tg, block_size, block_shift, row, lane_off);
  load_rows<T, U, kTpw>(vr, vc, tbl, b0, c0, t1, tg, block_size, block_shift, row, lane_off);
  // The loop bound is uniform over the warp (the shuffles need every lane).
  for (; c0 < t1; c0 += kStride) {
    float s[MAXG][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      unpack8<T>(kf, kr[u]);
#pragma unroll
      for (int g = 0; g < MAXG; ++g) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(qr[g][e], kf[e], d);
        s[g][u] = d;
      }
    }
    load_rows<T, U, kTpw>(kr, kc, tbl, b0, c0 + kStride, t1, tg, block_size, block_shift, row, lane_off);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool valid = c0 + u * kTpw + tg < t1;
#pragma unroll
      for (int g = 0; g < MAXG; ++g) {
        float d = s[g][u];
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (cap_log2 > 0.f) d = cap_log2 * tanhf(d * inv_cap);
        s[g][u] = valid ? d : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[g][u]);
      const float base = exp_base(mx);
      const float alpha = exp2f(m[g] - base);
      m[g] = mx;
      float sum = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        s[g][u] = exp2f(s[g][u] - base);
        sum += s[g][u];
      }
      l[g] = l[g] * alpha + sum;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      unpack8<T>(vf, vr[u]);
#pragma unroll
      for (int g = 0; g < MAXG; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(s[g][u], vf[e], acc[g][e]);
    }
    load_rows<T, U, kTpw>(vr, vc, tbl, b0, c0 + kStride, t1, tg, block_size, block_shift, row, lane_off);
  }

  // Merge the lane groups of each warp (same head_dim slice, different tokens).
#pragma unroll
  for (int o = kLanes; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float mx = fmaxf(m[g], mo), base = exp_base(mx);
      const float a = exp2f(m[g] - base), b = exp2f(mo - base);
      l[g] = l[g] * a + lo * b;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] = acc[g][e] * a + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * b;
      m[g] = mx;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
      wstat[0][warp][g] = m[g];
      wstat[1][warp][g] = l[g];
    }
  }
  for (int e = threadIdx.x; e < MAXG * D; e += kThreads) red[e] = 0.f;
  __syncthreads();

  // Merge the warps: rescale each to the CTA max and add up in shared memory.
  if (lane < kLanes) {
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
      if (g < nh) {
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wstat[0][w][g]);
        const float a = exp2f(m[g] - exp_base(mx));
#pragma unroll
        for (int e = 0; e < 8; ++e) atomicAdd(&red[g * D + sub * 8 + e], acc[g][e] * a);
      }
    }
  }
  if (threadIdx.x < MAXG) {
    const int g = threadIdx.x;
    float mx = -INFINITY, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wstat[0][w][g]);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += wstat[1][w][g] * exp2f(wstat[0][w][g] - exp_base(mx));
    fin[0][g] = mx;
    fin[1][g] = sum;
  }
  __syncthreads();

  if (parts == 1) {
    for (int e = threadIdx.x; e < nh * D; e += kThreads) out[head0 * D + e] = from_f32<T>(red[e] / fin[1][e / D]);
    return;
  }
  for (int e = threadIdx.x; e < nh * D; e += kThreads) part_out[((head0 + e / D) * parts + part) * D + e % D] = red[e];
  for (int g = threadIdx.x; g < nh; g += kThreads) {
    part_ml[(head0 + g) * parts + part] = fin[0][g];
    part_ml[(ml_l + head0 + g) * parts + part] = fin[1][g];
  }
}

constexpr int kReduceThreads = 256;

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kReduceThreads / 32 ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

// Combines the partitions of one (sequence, query head): rescale each by 2^(max_p - max) and normalise
// (the maxima are in base-2 units, as the decode kernel keeps them). Threads take float4 columns of the
// output and several partitions side by side, so many partial rows are in flight at once.
template <typename T, int D>
__global__ void __launch_bounds__(kReduceThreads) paged_decode_reduce_kernel(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_ml,
    const int32_t* __restrict__ seq_lens, int num_seqs, int q_heads, int parts, int partition_size) {
  constexpr int kCols = D / 4;
  constexpr int kRows = kReduceThreads / kCols;
  __shared__ float scratch[kReduceThreads / 32];
  __shared__ float4 rows[kRows][kCols];
  const size_t head = static_cast<size_t>(blockIdx.y) * q_heads + blockIdx.x;
  const int used = min(parts, (seq_lens[blockIdx.y] + partition_size - 1) / partition_size);
  const float* ms = part_ml + head * parts;
  const float* ls = part_ml + (static_cast<size_t>(num_seqs) * q_heads + head) * parts;
  float m = -INFINITY;
  for (int p = threadIdx.x; p < used; p += kReduceThreads) m = fmaxf(m, ms[p]);
  m = block_max(m, scratch);
  const float base = exp_base(m);
  float den = 0.f;
  for (int p = threadIdx.x; p < used; p += kReduceThreads) den += ls[p] * exp2f(ms[p] - base);
  den = block_sum(den);
  const int col = threadIdx.x % kCols, r = threadIdx.x / kCols;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int p = r; p < used; p += kRows) {
    if (ms[p] == -INFINITY) continue;  // an empty piece wrote no output row
    const float w = exp2f(ms[p] - base);
    const float4 x = __ldg(reinterpret_cast<const float4*>(part_out + (head * parts + p) * D) + col);
    acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
  }
  rows[r][col] = acc;
  __syncthreads();
  if (r == 0) {
    for (int i = 1; i < kRows; ++i) {
      const float4 x = rows[i][col];
      acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    T* o = out + head * D + col * 4;
    o[0] = from_f32<T>(acc.x * inv);
    o[1] = from_f32<T>(acc.y * inv);
    o[2] = from_f32<T>(acc.z * inv);
    o[3] = from_f32<T>(acc.w * inv);
  }
}

template <typename T, int V>
__global__ void reshape_and_cache_kernel(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ kc,
                                         T* __restrict__ vc, const int64_t* __restrict__ slots, int row,
                                         int64_t k_stride, int64_t v_stride) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  using Vt = Vec<T, V>;
  const Vt* ks = reinterpret_cast<const Vt*>(k + t * k_stride);
  const Vt* vs = reinterpret_cast<const Vt*>(v + t * v_stride);
  Vt* kd = reinterpret_cast<Vt*>(kc + slot * row);
  Vt* vd = reinterpret_cast<Vt*>(vc + slot * row);
  for (int i = threadIdx.x; i < row / V; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

template <typename T, int D, int MAXG>
void launch_decode(T* out, const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens,
                   float* part_out, float* part_ml, int64_t num_seqs, int64_t q_heads, int64_t kv_heads,
                   int64_t q_stride, int64_t block_size, int64_t max_blocks, int64_t partition_size, int64_t parts,
                   float scale, float softcap, int64_t window, cudaStream_t stream) {
  constexpr int kUnroll = MAXG <= 4 ? 8 : 4;  // tokens per lane group in flight; fewer with more heads (registers)
  const int64_t group = q_heads / kv_heads;
  const int64_t slices = (group + MAXG - 1) / MAXG;
  int shift = -1;  // block_size as a shift when it is a power of two
  if ((block_size & (block_size - 1)) == 0)
    for (shift = 0; (int64_t{1} << shift) < block_size; ++shift) {}
  // Scores are kept in base-2 units: the scale (and log2 e) is folded into q, or into the soft cap.
  const float qscale = softcap > 0.f ? scale : scale * kLog2e;
  const float cap_log2 = softcap > 0.f ? softcap * kLog2e : 0.f;
  const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
  const dim3 grid(static_cast<unsigned>(kv_heads * slices), static_cast<unsigned>(num_seqs), static_cast<unsigned>(parts));
  const size_t smem = table_slice_len(partition_size, block_size) * sizeof(int32_t);
  paged_decode_kernel<T, D, MAXG, kUnroll><<<grid, kThreads, smem, stream>>>(
      out, q, kc, vc, tables, lens, part_out, part_ml, static_cast<int>(group), static_cast<int>(slices),
      static_cast<int>(q_heads), static_cast<int>(kv_heads), q_stride, static_cast<int>(block_size), shift,
      static_cast<int>(max_blocks), static_cast<int>(partition_size), qscale, cap_log2, inv_cap, static_cast<int>(window));
  check_launch("paged_attention_decode");
  if (parts > 1) {
    const dim3 rgrid(static_cast<unsigned>(q_heads), static_cast<unsigned>(num_seqs));
    paged_decode_reduce_kernel<T, D><<<rgrid, kReduceThreads, 0, stream>>>(
        out, part_out, part_ml, lens, static_cast<int>(num_seqs), static_cast<int>(q_heads), static_cast<int>(parts),
        static_cast<int>(partition_size));
    check_launch("paged_attention_decode reduce");
  }
}

}  // namespace

void paged_attention_decode(void* out, const void* q, const void* key_cache, const void* value_cache,
                            const int32_t* block_tables, const int32_t* seq_lens, float* partial_out,
                            float* partial_ml, int64_t num_seqs, int64_t q_heads, int64_t kv_heads,
                            int64_t head_dim, int64_t q_stride, int64_t block_size, int64_t max_blocks,
                            int64_t partition_size, int64_t num_partitions, float scale, float softcap,
                            int64_t sliding_window, DType dtype, std::uintptr_t stream) {
  if (kv_heads < 1 || q_heads % kv_heads != 0 || q_heads / kv_heads > kAttnMaxGroup)
    throw std::invalid_argument("paged_attention_decode: q_heads must be a multiple of kv_heads, at most 16x");
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    throw std::invalid_argument("paged_attention_decode: head_dim must be 64, 128 or 256");
  if (block_size < 1) throw std::invalid_argument("paged_attention_decode: block_size must be positive");
  if (partition_size < 1 || num_partitions < 1) throw std::invalid_argument("paged_attention_decode: bad partitioning");
  if (table_slice_len(partition_size, block_size) * 4 > 48 * 1024)
    throw std::invalid_argument("paged_attention_decode: partition_size / block_size above 12286 (the CTA's block-table "
                                "slice must fit 48 KB of shared memory); use a smaller partition_size");
  if (num_partitions > 1 && (partial_out == nullptr || partial_ml == nullptr))
    throw std::invalid_argument("paged_attention_decode: split-KV needs partial buffers");
  if (num_seqs == 0) return;
  dispatch_float<false>(dtype, "paged_attention_decode", [&](auto tag) {
    using T = decltype(tag);
    const int64_t group = q_heads / kv_heads;
    auto run = [&](auto d_const, auto g_const) {
      launch_decode<T, decltype(d_const)::value, decltype(g_const)::value>(
          static_cast<T*>(out), static_cast<const T*>(q), static_cast<const T*>(key_cache),
          static_cast<const T*>(value_cache), block_tables, seq_lens, partial_out, partial_ml, num_seqs, q_heads,
          kv_heads, q_stride, block_size, max_blocks, partition_size, num_partitions, scale, softcap, sliding_window,
          as_stream(stream));
    };
    auto by_group = [&](auto d_const) {
      if (group == 1) run(d_const, std::integral_constant<int, 1>{});
      else if (group == 2) run(d_const, std::integral_constant<int, 2>{});
      else if (group <= 4) run(d_const, std::integral_constant<int, 4>{});
      else run(d_const, std::integral_constant<int, kAttnMaxSlice>{});
    };
    if (head_dim == 64) by_group(std::integral_constant<int, 64>{});
    else if (head_dim == 128) by_group(std::integral_constant<int, 128>{});
    else by_group(std::integral_constant<int, 256>{});
  });
}

void reshape_and_cache(const void* k, const void* v, void* key_cache, void* value_cache, const int64_t* slot_mapping,
                       int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride,
                       DType dtype, std::uintptr_t stream) {
  if (tokens == 0) return;
  dispatch_float<true>(dtype, "reshape_and_cache", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const int row = static_cast<int>(kv_heads * head_dim);
    const bool vec = row % kVec == 0 && k_stride % kVec == 0 && v_stride % kVec == 0 && aligned16(k, v, key_cache, value_cache);
    const int threads = std::min(512, std::max(32, ((vec ? row / kVec : row) + 31) / 32 * 32));
    auto go = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(tokens), threads, 0, as_stream(stream)>>>(
          static_cast<const T*>(k), static_cast<const T*>(v), static_cast<T*>(key_cache), static_cast<T*>(value_cache),
          slot_mapping, row, k_stride, v_stride);
    };
    if (vec) go(reshape_and_cache_kernel<T, kVec>);
    else go(reshape_and_cache_kernel<T, 1>);
  });
  check_launch("reshape_and_cache");
}

}  // namespace candle_vllm::cuda
