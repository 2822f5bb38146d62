// Paged decode attention over TurboQuant rows (turbo_kv.h): the CUDA-core kernel, the reduce of its pieces, and the
// launcher that picks the tensor-core kernel (turbo_decode_tc.cu) where it takes the geometry. Scores follow the
// rows' codes (keys rotated, so each CTA rotates its queries alike: turbo_rows.cuh's load_queries).
#include <cmath>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/fp8_kv.cuh"
#include "cuda/turbo_decode_tc.h"
#include "cuda/turbo_kv.h"
#include "cuda/turbo_rows.cuh"

namespace candle_vllm::cuda {
namespace {

using turbo::check_bits;
using turbo::dispatch_lanes;
using turbo::kDecodeWarps;
using turbo::load_f32;
using turbo::RowLayout;
using turbo::sqrt_of;

// One token's K part (the calling lane's) scored against the CTA's G queries in shared memory, rotated and scaled:
// code sums sum_d q_d c_d for 4 / 3 bits (the caller applies the absmax), q . k for e4m3. Rows are 4-byte aligned.
template <int D, int G>
__device__ __forceinline__ void key_scores(const uint8_t* row, int k_bits, const float (*qs)[D], float (&s)[G]) {
#pragma unroll
  for (int g = 0; g < G; ++g) s[g] = 0.f;
  if (k_bits == 8) {
#pragma unroll 4
    for (int w = 0; w < D / 4; ++w) {
      const uint32_t word = *reinterpret_cast<const uint32_t*>(row + 4 * w);
      float c[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        Fp8 f;
        f.__x = static_cast<__nv_fp8_storage_t>((word >> (8 * b)) & 0xff);
        c[b] = static_cast<float>(f);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float4 qv = reinterpret_cast<const float4*>(qs[g])[w];
        s[g] += qv.x * c[0] + qv.y * c[1] + qv.z * c[2] + qv.w * c[3];
      }
    }
    return;
  }
#pragma unroll 2
  for (int w = 0; w < D / 8; ++w) {
    uint32_t word;
    if (k_bits == 4) {
      word = *reinterpret_cast<const uint32_t*>(row + 4 * w);
    } else {
      const uint8_t* p = row + 3 * w;
      word = p[0] | (p[1] << 8) | (p[2] << 16);
    }
    const int shift = k_bits == 4 ? 4 : 3, mask = k_bits == 4 ? 15 : 7;
    float c[8];
#pragma unroll
    for (int n = 0; n < 8; ++n) c[n] = static_cast<float>((word >> (shift * n)) & mask);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float4 lo = reinterpret_cast<const float4*>(qs[g])[2 * w];
      const float4 hi = reinterpret_cast<const float4*>(qs[g])[2 * w + 1];
      s[g] += lo.x * c[0] + lo.y * c[1] + lo.z * c[2] + lo.w * c[3] + hi.x * c[4] + hi.y * c[5] + hi.z * c[6] +
              hi.w * c[7];
    }
  }
}

// One CTA per (piece, kv head and chunk of its q heads, sequence), covering G q heads (G rounds the group up to 1, 2,
// 4 or 8; larger groups take chunks of 8; the extra heads are zero queries whose results are dropped), so each row
// is read once for all of them. Scores:
// a lane per token, 32 tokens a warp per trip, the queries in shared memory. P V: a lane per E channels, the 32
// tokens' V codes read coalesced row by row. Each warp keeps an online softmax per head; the warps merge through
// shared memory at the end.
template <typename T, int E, int G>
__global__ void __launch_bounds__(32 * kDecodeWarps)
    turbo_decode_kernel(T* out, const T* q, int64_t q_stride, const uint8_t* cache, const int32_t* block_tables,
                        const int32_t* seq_lens,
                        const float* signs, float* partials, int q_heads, int kv_heads, int block_size,
                        int max_blocks, int piece_unit, float scale, int sliding_window, float softcap, int k_bits,
                        float sqrt_d) {
  constexpr int D = 32 * E;
  __shared__ __align__(16) float sm_q[G][D];
  __shared__ float sm_qsum[G];
  __shared__ float sm_p[kDecodeWarps][G][32];
  __shared__ float sm_m[kDecodeWarps][G], sm_l[kDecodeWarps][G];
  __shared__ float sm_acc[kDecodeWarps][G][D];
  pdl_wait();  // q, the step's new rows (and, in a mixed step, its gathered lengths) come from kernels before
  const turbo::DecodeCta<G> cta(q_heads, kv_heads, seq_lens, piece_unit, sliding_window);
  if (cta.idle()) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const RowLayout L(D, k_bits);
  turbo::load_queries<T, E, G, false>(sm_q, sm_qsum, q + cta.q_at(q_stride, q_heads, D), cta.heads, scale,
                                      k_bits != 8 ? signs : nullptr, sqrt_d);
  __syncthreads();
  const float k_half = k_bits == 4 ? 7.5f : 3.f;
  const int32_t* table = block_tables + static_cast<int64_t>(cta.seq) * max_blocks;
  float m[G], l[G], acc[G][E];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }
  for (int base = cta.lo + warp * 32; base < cta.hi; base += kDecodeWarps * 32) {
    const int j = base + lane;
    const bool live = j < cta.hi;
    const int jj = live ? j : cta.hi - 1;
    const int64_t slot = static_cast<int64_t>(table[jj / block_size]) * block_size + jj % block_size;
    const uint8_t* row = cache + (slot * kv_heads + cta.kvh) * L.row_bytes;
    const uint8_t* my_v = row + L.k_bytes;
    const float my_v_step = load_f32(my_v + D / 2) / 7.5f;
    float s[G];
    key_scores<D, G>(row, k_bits, sm_q, s);
    const float k_scale = k_bits != 8 ? load_f32(row + L.k_code_bytes) / k_half : 1.f;
    float corr[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float x = k_bits != 8 ? k_scale * (s[g] - k_half * sm_qsum[g]) : s[g];
      if (softcap > 0.f) x = softcap * tanhf(x / softcap);
      x = live ? x : -INFINITY;
      const float new_m = fmaxf(m[g], warp_max(x));
      corr[g] = __expf(m[g] - new_m);
      const float p = __expf(x - new_m);
      l[g] = l[g] * corr[g] + warp_sum(p);
      m[g] = new_m;
      sm_p[warp][g][lane] = p;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= corr[g];
    }
    __syncwarp();
    const int n = min(32, cta.hi - base);
#pragma unroll 4
    for (int t = 0; t < n; ++t) {
      const auto* vrow = reinterpret_cast<const uint8_t*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_v), t));
      const float v_step = __shfl_sync(0xffffffffu, my_v_step, t);
      uint32_t bytes[E / 2];
#pragma unroll
      for (int b = 0; b < E / 2; ++b) bytes[b] = vrow[lane * (E / 2) + b];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pv = sm_p[warp][g][t] * v_step;
#pragma unroll
        for (int b = 0; b < E / 2; ++b) {
          acc[g][2 * b] += pv * (static_cast<float>(bytes[b] & 15) - 7.5f);
          acc[g][2 * b + 1] += pv * (static_cast<float>(bytes[b] >> 4) - 7.5f);
        }
      }
    }
    __syncwarp();
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) sm_m[warp][g] = m[g], sm_l[warp][g] = l[g];
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][g][lane * E + e] = acc[g][e];
  }
  pdl_launch_dependents();  // the reduce or o_proj may start launching; it waits for this grid
  __syncthreads();
  turbo::merge_warps<T, E, G>(out, partials, sm_m, sm_l, sm_acc, cta);
}


// One warp per (q head, sequence): the live pieces' partial softmaxes combined (idle pieces write none).
template <typename T, int E>
__global__ void turbo_reduce_kernel(T* out, const float* partials, const int32_t* seq_lens, int parts,
                                    int piece_unit, int sliding_window) {
  constexpr int D = 32 * E;
  const int lane = threadIdx.x;
  const int64_t qh = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  pdl_launch_dependents();
  const float* p = partials + qh * parts * (D + 2);
  const int live = turbo::live_pieces(seq_lens[blockIdx.y], piece_unit, parts, sliding_window);
  pdl_wait();  // the partials come from the decode kernel
  float big = -INFINITY;
  for (int i = 0; i < live; ++i) big = fmaxf(big, p[i * (D + 2)]);
  float sum = 0.f, o[E];
#pragma unroll
  for (int e = 0; e < E; ++e) o[e] = 0.f;
  for (int i = 0; i < live; ++i) {
    const float* pi = p + i * (D + 2);
    if (pi[1] == 0.f) continue;
    const float f = __expf(pi[0] - big);
    sum += pi[1] * f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] += pi[2 + lane * E + e] * f;
  }
#pragma unroll
  for (int e = 0; e < E; ++e) out[qh * D + lane * E + e] = from_f32<T>(sum > 0.f ? o[e] / sum : 0.f);
}

}  // namespace

void turbo_decode_attention(void* out, const void* q, int64_t q_stride, const void* cache,
                            const int32_t* block_tables, const int32_t* seq_lens, const float* signs,
                            float* partials, int64_t num_seqs,
                            int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t max_blocks, int64_t parts, int64_t piece_unit, float scale,
                            int64_t sliding_window, float softcap, int k_bits, bool tensor_cores, DType dtype,
                            std::uintptr_t stream) {
  const char* what = "turbo_decode_attention";
  check_bits(k_bits, what);
  if (num_seqs == 0) return;
  if (parts < 1 || parts > 65535 || num_seqs > 65535 || piece_unit < 1 || piece_unit > (1 << 20) || kv_heads < 1 ||
      q_heads % kv_heads != 0)
    throw std::invalid_argument(std::string(what) + ": 1-65535 pieces and sequences, a piece unit of 1-2^20 tokens, "
                                "q heads a multiple of kv heads");
  const TurboDecodeArgs args{out, q, q_stride, cache, block_tables, seq_lens, signs, partials,
                             static_cast<int>(q_heads),
                             static_cast<int>(kv_heads), static_cast<int>(block_size), static_cast<int>(max_blocks),
                             static_cast<int>(piece_unit), scale, static_cast<int>(sliding_window), softcap,
                             sqrt_of(head_dim)};
  const bool on_tensor_cores =
      tensor_cores && turbo_decode_tc(args, num_seqs, parts, static_cast<int>(head_dim), k_bits, dtype, stream);
  dispatch_float<false>(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    dispatch_lanes(head_dim, what, [&](auto e) {
      constexpr int E = decltype(e)::value;
      const int64_t group = q_heads / kv_heads;
      auto on_cuda_cores = [&](auto g) {
        constexpr int G = decltype(g)::value;
        const dim3 grid(static_cast<unsigned>(parts), static_cast<unsigned>(kv_heads * ((group + G - 1) / G)),
                        static_cast<unsigned>(num_seqs));
        launch_pdl(what, turbo_decode_kernel<T, E, G>, grid, dim3(32 * kDecodeWarps), 0, as_stream(stream),
            static_cast<T*>(out), static_cast<const T*>(q), q_stride, static_cast<const uint8_t*>(cache), block_tables,
            seq_lens, signs, partials, static_cast<int>(q_heads), static_cast<int>(kv_heads),
            static_cast<int>(block_size), static_cast<int>(max_blocks), static_cast<int>(piece_unit), scale,
            static_cast<int>(sliding_window), softcap, k_bits, sqrt_of(head_dim));
      };
      if (!on_tensor_cores) {
        if (group == 1) on_cuda_cores(std::integral_constant<int, 1>{});
        else if (group == 2) on_cuda_cores(std::integral_constant<int, 2>{});
        else if (group <= 4) on_cuda_cores(std::integral_constant<int, 4>{});
        else on_cuda_cores(std::integral_constant<int, 8>{});
      }
      check_launch(what);
      if (parts > 1) {
        const dim3 reduce_grid(static_cast<unsigned>(q_heads), static_cast<unsigned>(num_seqs));
        launch_pdl(what, turbo_reduce_kernel<T, E>, reduce_grid, dim3(32), 0, as_stream(stream),
                   static_cast<T*>(out), partials, seq_lens, static_cast<int>(parts), static_cast<int>(piece_unit),
                   static_cast<int>(sliding_window));
        check_launch(what);
      }
    });
  });
}

}  // namespace candle_vllm::cuda
