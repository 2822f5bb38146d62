// Paged decode attention (split-KV, GQA-aware) and the KV-cache write.
//
// Grid (kv_head, sequence, partition). A CTA serves every query head of its kv head, so each K/V byte of the
// partition is read once for the whole group. Lanes split head_dim in 16-byte pieces (D/8 lanes per token), so
// a warp covers 32/(D/8) tokens at a time and each lane keeps several tokens' loads in flight.
//   1. scores[g][j] = (q_g . k_j) * scale (soft-capped) for the partition's tokens, into shared memory;
//   2. per head (one warp each): max, exp, sum;
//   3. out_g = sum_j p[g][j] v_j, lanes accumulating in registers, token groups summed in shared memory.
// With one partition the CTA writes the normalised output; otherwise it writes (unnormalised out, max, sum)
// and a reduce kernel rescales and combines the partitions.
#include <cmath>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/paged_attention.h"

namespace candle_vllm::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kUnroll = 4;  // tokens per lane group per iteration (loads in flight)

template <typename T>
__device__ __forceinline__ void load8(float (&dst)[8], const T* src) {
  const Vec<T, 8> v = *reinterpret_cast<const Vec<T, 8>*>(src);
#pragma unroll
  for (int e = 0; e < 8; ++e) dst[e] = to_f32(v.v[e]);
}

template <typename T, int D, int MAXG>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(
    T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens, float* __restrict__ part_out,
    float* __restrict__ part_ml, int group, int q_heads, int kv_heads, int64_t q_stride, int block_size,
    int max_blocks, int partition_size, float scale, float softcap, int sliding_window) {
  constexpr int kLanes = D / 8;                       // lanes per token
  constexpr int kGroups = kThreads / kLanes;          // tokens processed side by side by the CTA
  extern __shared__ float smem[];
  float* scores = smem;                                // [group][partition_size]
  float* red = scores + group * partition_size;        // [group][D]
  float* stat = red + group * D;                       // [group] max, [group] sum

  const int kvh = blockIdx.x, seq = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tg = threadIdx.x / kLanes, sub = threadIdx.x % kLanes;
  const int ctx = seq_lens[seq];
  const int first = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
  const int t0 = max(part * partition_size, first), t1 = min((part + 1) * partition_size, ctx);
  const int n = t1 - t0;
  const size_t head0 = static_cast<size_t>(seq) * q_heads + kvh * group;  // first query head of this CTA

  if (n <= 0) {  // empty piece (past the context, or before the window): contributes nothing
    if (parts > 1) {
      for (int g = threadIdx.x; g < group; g += kThreads) {
        part_ml[(head0 + g) * parts + part] = -INFINITY;
        part_ml[(static_cast<size_t>(gridDim.y) * q_heads + head0 + g) * parts + part] = 0.f;
      }
    } else {
      for (int e = threadIdx.x; e < group * D; e += kThreads) out[head0 * D + e] = from_f32<T>(0.f);
    }
    return;
  }

  const int32_t* table = block_tables + static_cast<size_t>(seq) * max_blocks;
  const size_t row = static_cast<size_t>(kv_heads) * D;  // elements per cache slot
  auto slot_ptr = [&](const T* cache, int j) {
    const int blk = table[j / block_size];
    return cache + (static_cast<size_t>(blk) * block_size + j % block_size) * row + static_cast<size_t>(kvh) * D + sub * 8;
  };

  // Phase 1: scores.
  float qr[MAXG][8];
  const T* qbase = q + static_cast<size_t>(seq) * q_stride + static_cast<size_t>(kvh) * group * D + sub * 8;
#pragma unroll
  for (int g = 0; g < MAXG; ++g) {
    if (g < group) {
      load8(qr[g], qbase + static_cast<size_t>(g) * D);
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[g][e] *= scale;
    }
  }
  // The loop bound is uniform over the CTA (the shuffles below need every lane of the warp).
  for (int base = t0; base < t1; base += kGroups * kUnroll) {
    float kv[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + tg + u * kGroups;
      if (j < t1) load8(kv[u], slot_ptr(kc, j));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + tg + u * kGroups;
      // Lanes of one token stay together; a token past t1 still joins the shuffles (no divergence inside).
#pragma unroll
      for (int g = 0; g < MAXG; ++g) {
        if (g < group) {
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) s += qr[g][e] * kv[u][e];
#pragma unroll
          for (int o = kLanes / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
          if (softcap > 0.f) s = softcap * tanhf(s / softcap);
          if (sub == 0 && j < t1) scores[g * partition_size + (j - t0)] = s;
        }
      }
    }
  }
  __syncthreads();

  // Phase 2: softmax statistics, one warp per head.
  for (int g = warp; g < group; g += kThreads / 32) {
    float* sg = scores + g * partition_size;
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, sg[i]);
    m = warp_max(m);
    float l = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float p = __expf(sg[i] - m);
      sg[i] = p;
      l += p;
    }
    l = warp_sum(l);
    if (lane == 0) { stat[g] = m; stat[group + g] = l; }
  }
  for (int e = threadIdx.x; e < group * D; e += kThreads) red[e] = 0.f;
  __syncthreads();

  // Phase 3: probabilities times values.
  float acc[MAXG][8];
#pragma unroll
  for (int g = 0; g < MAXG; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  for (int base = t0 + tg; base < t1; base += kGroups * kUnroll) {
    float vv[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kGroups;
      if (j < t1) load8(vv[u], slot_ptr(vc, j));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kGroups;
      if (j >= t1) continue;
#pragma unroll
      for (int g = 0; g < MAXG; ++g) {
        if (g < group) {
          const float p = scores[g * partition_size + (j - t0)];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] += p * vv[u][e];
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < MAXG; ++g) {
    if (g < group) {
#pragma unroll
      for (int e = 0; e < 8; ++e) atomicAdd(&red[g * D + sub * 8 + e], acc[g][e]);
    }
  }
  __syncthreads();

  if (parts == 1) {
    for (int e = threadIdx.x; e < group * D; e += kThreads) out[head0 * D + e] = from_f32<T>(red[e] / stat[group + e / D]);
    return;
  }
  for (int e = threadIdx.x; e < group * D; e += kThreads) {
    const int g = e / D, d = e % D;
    part_out[((head0 + g) * parts + part) * D + d] = red[e];
  }
  for (int g = threadIdx.x; g < group; g += kThreads) {
    part_ml[(head0 + g) * parts + part] = stat[g];
    part_ml[(static_cast<size_t>(gridDim.y) * q_heads + head0 + g) * parts + part] = stat[group + g];
  }
}

// Combines the partitions of one (sequence, query head): rescale each by exp(max_p - max) and normalise.
template <typename T>
__global__ void paged_decode_reduce_kernel(T* __restrict__ out, const float* __restrict__ part_out,
                                           const float* __restrict__ part_ml, const int32_t* __restrict__ seq_lens,
                                           int num_seqs, int q_heads, int head_dim, int parts, int partition_size) {
  const size_t head = static_cast<size_t>(blockIdx.y) * q_heads + blockIdx.x;
  const int used = min(parts, (seq_lens[blockIdx.y] + partition_size - 1) / partition_size);
  const float* ms = part_ml + head * parts;
  const float* ls = part_ml + (static_cast<size_t>(num_seqs) * q_heads + head) * parts;
  float m = -INFINITY;
  for (int p = 0; p < used; ++p) m = fmaxf(m, ms[p]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int p = 0; p < used; ++p) {
      if (ms[p] == -INFINITY) continue;
      const float w = __expf(ms[p] - m);
      num += w * part_out[(head * parts + p) * head_dim + d];
      den += w * ls[p];
    }
    out[head * head_dim + d] = from_f32<T>(den > 0.f ? num / den : 0.f);
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
  const int64_t group = q_heads / kv_heads;
  const int64_t smem = paged_attention_smem_bytes(group, D, partition_size);
  const dim3 grid(static_cast<unsigned>(kv_heads), static_cast<unsigned>(num_seqs), static_cast<unsigned>(parts));
  paged_decode_kernel<T, D, MAXG><<<grid, kThreads, smem, stream>>>(
      out, q, kc, vc, tables, lens, part_out, part_ml, static_cast<int>(group), static_cast<int>(q_heads),
      static_cast<int>(kv_heads), q_stride, static_cast<int>(block_size), static_cast<int>(max_blocks),
      static_cast<int>(partition_size), scale, softcap, static_cast<int>(window));
  check_launch("paged_attention_decode");
  if (parts > 1) {
    paged_decode_reduce_kernel<T><<<dim3(static_cast<unsigned>(q_heads), static_cast<unsigned>(num_seqs)), D, 0, stream>>>(
        out, part_out, part_ml, lens, static_cast<int>(num_seqs), static_cast<int>(q_heads), D,
        static_cast<int>(parts), static_cast<int>(partition_size));
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
  if (partition_size < 1 || num_partitions < 1) throw std::invalid_argument("paged_attention_decode: bad partitioning");
  if (num_partitions > 1 && (partial_out == nullptr || partial_ml == nullptr))
    throw std::invalid_argument("paged_attention_decode: split-KV needs partial buffers");
  if (paged_attention_smem_bytes(q_heads / kv_heads, head_dim, partition_size) > kAttnSmemLimit)
    throw std::invalid_argument("paged_attention_decode: partition_size too large for shared memory");
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
      if (group <= 4) run(d_const, std::integral_constant<int, 4>{});
      else if (group <= 8) run(d_const, std::integral_constant<int, 8>{});
      else run(d_const, std::integral_constant<int, 16>{});
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
