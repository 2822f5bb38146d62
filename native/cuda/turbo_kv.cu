// TurboQuant rows (pyengine/kv_cache/turbo.py): [K codes | K absmax f32 (4 / 3 bits) | V 4-bit codes | V absmax].
// One warp holds one head vector, E = D / 32 consecutive channels a lane, so the Walsh-Hadamard transform is E-wide
// butterflies in registers then five shuffle stages, in the reference's stage order (the rotated keys equal
// torch's bit for bit). The codes follow the reference's f32 operations one IEEE op at a time (explicit _rn
// intrinsics: this file is built with fast math), so the stored bytes are the reference's.
// This file: the rows' write and their decoding to dense blocks; turbo_decode.cu holds the decode attention.
#include <cmath>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/fp8_kv.cuh"
#include "cuda/turbo_encode.cuh"
#include "cuda/turbo_kv.h"
#include "cuda/turbo_rows.cuh"

namespace candle_vllm::cuda {
namespace {

using turbo::check_bits;
using turbo::dequant;
using turbo::dispatch_lanes;
using turbo::encode_k;
using turbo::encode_v;
using turbo::load_f32;
using turbo::load_lane;
using turbo::RowLayout;
using turbo::sqrt_of;
using turbo::store_lane;
using turbo::unrotated_k;

// The calling lane's E codes of `bits` bits (channels lane * E ...), as packed by store_nibbles / store_triples.
template <int E>
__device__ __forceinline__ void load_codes(int (&code)[E], const uint8_t* packed, int bits) {
  const int lane = threadIdx.x & 31;
  if (bits == 4) {
#pragma unroll
    for (int b = 0; b < E / 2; ++b) {
      const int byte = packed[lane * (E / 2) + b];
      code[2 * b] = byte & 15;
      code[2 * b + 1] = byte >> 4;
    }
    return;
  }
  const uint8_t* p = packed + 3 * (lane * E / 8);
  const uint32_t word = (p[0] | (p[1] << 8) | (p[2] << 16)) >> (3 * ((lane * E) % 8));
#pragma unroll
  for (int e = 0; e < E; ++e) code[e] = (word >> (3 * e)) & 7;
}

// One warp per (token, kv head). With k_back / v_back (same strides as k / v; they may alias them) the warp also
// stores the values its row decodes to (K turned back, as turbo_blocks_kernel gives them), so attention over the
// step's own K/V sees what later steps read from the cache.
template <typename T, int E>
__global__ void turbo_write_kernel(const T* k, const T* v, T* k_back, T* v_back, uint8_t* cache, const int64_t* slots,
                                   const float* signs, int64_t tokens, int kv_heads, int64_t k_stride,
                                   int64_t v_stride, int k_bits, float sqrt_d) {
  constexpr int D = 32 * E;
  const int64_t work = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (work >= tokens * kv_heads) return;
  const int64_t t = work / kv_heads;
  const int h = static_cast<int>(work % kv_heads);
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const RowLayout L(D, k_bits);
  uint8_t* row = cache + (slot * kv_heads + h) * L.row_bytes;
  const int64_t k_at = t * k_stride + static_cast<int64_t>(h) * D, v_at = t * v_stride + static_cast<int64_t>(h) * D;
  float x[E];
  load_lane(x, k + k_at);
  encode_k(x, row, L, k_bits, signs, sqrt_d, k_back != nullptr);
  if (k_back != nullptr) store_lane(k_back + k_at, x);
  load_lane(x, v + v_at);
  encode_v(x, row, L, v_back != nullptr);
  if (v_back != nullptr) store_lane(v_back + v_at, x);
}

// One warp per row of the listed blocks: K decoded and turned back (signs * H k' / sqrt_d), V decoded, both stored
// as dense [2, n, block_size, Hk, D] blocks.
template <typename T, int E>
__global__ void turbo_blocks_kernel(T* out, const uint8_t* cache, const int64_t* blocks, const float* signs,
                                    int64_t rows, int block_rows, int k_bits, float sqrt_d) {
  constexpr int D = 32 * E;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const RowLayout L(D, k_bits);
  const uint8_t* row = cache + (blocks[r / block_rows] * block_rows + r % block_rows) * L.row_bytes;
  float x[E];
  int code[E];
  if (k_bits == 8) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      Fp8 f;
      f.__x = static_cast<__nv_fp8_storage_t>(row[lane * E + e]);
      x[e] = static_cast<float>(f);
    }
  } else {
    const float half = k_bits == 4 ? 7.5f : 3.f;
    load_codes(code, row, k_bits);
    unrotated_k(x, code, load_f32(row + L.k_code_bytes), half, signs, sqrt_d);
  }
  store_lane(out + r * D, x);
  load_codes(code, row + L.k_bytes, 4);
  dequant(x, code, load_f32(row + L.k_bytes + D / 2), 7.5f);
  store_lane(out + (rows + r) * D, x);
}



}  // namespace

void turbo_cache_write(const void* k, const void* v, void* cache, const int64_t* slots, const float* signs,
                       int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride,
                       int k_bits, bool round_trip, DType dtype, std::uintptr_t stream) {
  const char* what = "turbo_cache_write";
  check_bits(k_bits, what);
  if (tokens == 0) return;
  dispatch_float<false>(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    dispatch_lanes(head_dim, what, [&](auto e) {
      constexpr int kWarps = 8;
      const int64_t blocks = (tokens * kv_heads + kWarps - 1) / kWarps;
      turbo_write_kernel<T, decltype(e)::value><<<static_cast<unsigned>(blocks), 32 * kWarps, 0, as_stream(stream)>>>(
          static_cast<const T*>(k), static_cast<const T*>(v),
          round_trip ? static_cast<T*>(const_cast<void*>(k)) : nullptr,
          round_trip ? static_cast<T*>(const_cast<void*>(v)) : nullptr, static_cast<uint8_t*>(cache), slots, signs,
          tokens,
          static_cast<int>(kv_heads), k_stride, v_stride, k_bits, sqrt_of(head_dim));
      check_launch(what);
    });
  });
}

void turbo_blocks_to_dense(void* out, const void* cache, const int64_t* blocks, const float* signs, int64_t num_blocks,
                           int64_t block_size, int64_t kv_heads, int64_t head_dim, int k_bits, DType dtype,
                           std::uintptr_t stream) {
  const char* what = "turbo_blocks_to_dense";
  check_bits(k_bits, what);
  if (num_blocks == 0) return;
  dispatch_float<false>(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    dispatch_lanes(head_dim, what, [&](auto e) {
      constexpr int kWarps = 8;
      const int64_t rows = num_blocks * block_size * kv_heads;
      turbo_blocks_kernel<T, decltype(e)::value><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), 32 * kWarps, 0,
                                                   as_stream(stream)>>>(
          static_cast<T*>(out), static_cast<const uint8_t*>(cache), blocks, signs, rows,
          static_cast<int>(block_size * kv_heads), k_bits, sqrt_of(head_dim));
      check_launch(what);
    });
  });
}

}  // namespace candle_vllm::cuda
