// The KV-cache write (reshape_and_cache, declared in paged_attention.h): each token's k and v rows stored at its
// flat cache slot, padding slots (< 0) skipped; an e4m3 cache stores each value as fp8_kv.cuh's to_e4m3.
#include <algorithm>
#include <stdexcept>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/fp8_kv.cuh"
#include "cuda/paged_attention.h"

namespace candle_vllm::cuda {
namespace {

template <typename T, typename KV, int V>
__global__ void reshape_and_cache_kernel(const T* k, const T* v, KV* __restrict__ kc,
                                         KV* __restrict__ vc, const int64_t* __restrict__ slots, int row,
                                         int64_t k_stride, int64_t v_stride) {
  pdl_launch_dependents();
  pdl_wait();  // k, v and the slots come from earlier kernels; the cache rows may still be read by them
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  using Vt = Vec<T, V>;
  using Vc = Vec<KV, V>;
  const Vt* ks = reinterpret_cast<const Vt*>(k + t * k_stride);
  const Vt* vs = reinterpret_cast<const Vt*>(v + t * v_stride);
  Vc* kd = reinterpret_cast<Vc*>(kc + slot * row);
  Vc* vd = reinterpret_cast<Vc*>(vc + slot * row);
  for (int i = threadIdx.x; i < row / V; i += blockDim.x) {
    kd[i] = to_cache<KV>(ks[i]);
    vd[i] = to_cache<KV>(vs[i]);
  }
}

// k and v rows of token blockIdx.x rounded in place to what an e4m3 cache holds of them.
template <typename T, int V>
__global__ void round_to_e4m3_kernel(T* k, T* v, int row, int64_t k_stride, int64_t v_stride) {
  using Vt = Vec<T, V>;
  const int64_t t = blockIdx.x;
  const int vecs = row / V;
  for (int i = threadIdx.x; i < 2 * vecs; i += blockDim.x) {
    Vt* p = reinterpret_cast<Vt*>(i < vecs ? k + t * k_stride : v + t * v_stride) + i % vecs;
    Vt x = *p;
#pragma unroll
    for (int j = 0; j < V; ++j) x.v[j] = from_f32<T>(static_cast<float>(to_e4m3(to_f32(x.v[j]))));
    *p = x;
  }
}

}  // namespace

void round_to_e4m3(void* k, void* v, int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t k_stride,
                   int64_t v_stride, DType dtype, std::uintptr_t stream) {
  if (tokens == 0) return;
  dispatch_float<false>(dtype, "round_to_e4m3", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const int row = static_cast<int>(kv_heads * head_dim);
    const bool vec = row % kVec == 0 && k_stride % kVec == 0 && v_stride % kVec == 0 && aligned16(k, v);
    const int threads = std::min(512, std::max(32, ((vec ? 2 * row / kVec : 2 * row) + 31) / 32 * 32));
    auto kernel = vec ? round_to_e4m3_kernel<T, kVec> : round_to_e4m3_kernel<T, 1>;
    kernel<<<static_cast<unsigned>(tokens), threads, 0, as_stream(stream)>>>(static_cast<T*>(k), static_cast<T*>(v),
                                                                             row, k_stride, v_stride);
    check_cuda(cudaGetLastError(), "round_to_e4m3");
  });
}

void reshape_and_cache(const void* k, const void* v, void* key_cache, void* value_cache, const int64_t* slot_mapping,
                       int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride,
                       DType dtype, DType cache_dtype, std::uintptr_t stream) {
  if (cache_dtype != dtype && cache_dtype != DType::F8E4M3)
    throw std::invalid_argument("reshape_and_cache: the cache must hold k's dtype or e4m3");
  if (tokens == 0) return;
  dispatch_float<true>(dtype, "reshape_and_cache", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const int row = static_cast<int>(kv_heads * head_dim);
    const bool vec = row % kVec == 0 && k_stride % kVec == 0 && v_stride % kVec == 0 && aligned16(k, v, key_cache, value_cache);
    const int threads = std::min(512, std::max(32, ((vec ? row / kVec : row) + 31) / 32 * 32));
    auto go = [&](auto kv_tag) {
      using KV = decltype(kv_tag);
      auto kernel = vec ? reshape_and_cache_kernel<T, KV, kVec> : reshape_and_cache_kernel<T, KV, 1>;
      launch_pdl("reshape_and_cache", kernel, dim3(static_cast<unsigned>(tokens)), dim3(threads), 0, as_stream(stream),
                 static_cast<const T*>(k), static_cast<const T*>(v), static_cast<KV*>(key_cache),
                 static_cast<KV*>(value_cache), slot_mapping, row, k_stride, v_stride);
    };
    if constexpr (std::is_same_v<T, float>) {
      if (cache_dtype == DType::F8E4M3) throw std::invalid_argument("reshape_and_cache: an e4m3 cache takes f16/bf16 k/v");
      go(T{});
    } else if (cache_dtype == DType::F8E4M3) {
      go(Fp8{});
    } else {
      go(T{});
    }
  });
}

}  // namespace candle_vllm::cuda
