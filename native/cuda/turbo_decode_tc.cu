// Paged decode attention over TurboQuant rows on the tensor cores (f16 mma.m16n8k16, f32 accumulators); the CUDA-core
// kernel in turbo_decode.cu takes the geometries this one does not.
//
// A CTA per (piece, kv head and chunk of up to 8 of its q heads, sequence), 4 warps, each taking 16-token tiles in
// turn. The heads are the mma's n (8 columns), so no row of either product is padding:
// - scores S^T [16 tokens x 8 heads] = K codes [16 x D] . Q^T: the codes go in as exact small integers (a nibble
//   or 3-bit field OR-ed into the mantissa of f16 1024, so 1024 + code), each token's absmax and the heads' sums
//   fold the (code - half) * absmax / half decoding and that bias into the scores afterwards;
// - after the online softmax (per head, in registers), P^T is transposed in registers (movmatrix) into the B
//   operand of out^T [D x 8 heads] += V codes^T [D x 16 tokens] . P'^T, with P' = p * absmax_v / 7.5 in the
//   activations' type (bf16's range holds any absmax), and the code offset (7.5 + bias) * sum(P') taken off at
//   the end.
// The channels are permuted inside each mma k-block (Q and K alike) and across the output's m-tiles so that a
// thread's operands come from whole words of its rows: a quarter of each key row, an eighth of each value row.
// Each warp loads its next tile's words into registers before it multiplies the current one.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"
#include "cuda/smem_pipe.cuh"
#include "cuda/turbo_decode_tc.h"
#include "cuda/turbo_rows.cuh"

namespace candle_vllm::cuda {
namespace {

using turbo::kDecodeWarps;
using turbo::load_f32;

constexpr int kTile = 16;   // tokens a warp takes at a time: the k of the P V product
constexpr int kHeads = 8;   // q heads a CTA serves: the n of both products
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr uint32_t kLowNibbles = 0x000F000Fu;

constexpr int low_bit(int n) { return n & -n; }

template <int D, int KBITS>
struct TcRows {
  static constexpr int kCodeBytes = D * KBITS / 8;
  static constexpr int kKBytes = kCodeBytes + (KBITS == 8 ? 0 : 4);
  static constexpr int kRowBytes = kKBytes + D / 2 + 4;
  static constexpr int kKThread = kCodeBytes / 4;  // key code bytes of a thread: a quarter of the head's channels
  static constexpr int kVThread = D / 16;          // value code bytes of a thread: an eighth of the channels
  static constexpr int kKWords = kKThread / 4, kVWords = kVThread / 4;
  static constexpr int kKAlign = std::min({low_bit(kRowBytes), low_bit(kKThread), 16});
  static constexpr int kVAlign = std::min({low_bit(kRowBytes), low_bit(kKBytes), low_bit(kVThread), 16});
};

// Head sizes whose key and value codes split into whole 32-bit words per thread (not 3-bit keys at D = 64).
template <int D, int KBITS>
constexpr bool tc_takes() {
  return (D == 64 || D == 128) && D * KBITS / 32 % 4 == 0 && D / 16 % 4 == 0;
}

template <int W, int ALIGN>
__device__ __forceinline__ void load_words(uint32_t (&w)[W], const uint8_t* p) {
  if constexpr (ALIGN >= 16 && W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (ALIGN >= 8 && W % 2 == 0) {
#pragma unroll
    for (int i = 0; i < W / 2; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = reinterpret_cast<const uint32_t*>(p)[i];
  }
}

// Two integer fields at bits 0 and 16 as a T pair of the values kCodeBias<T> + field: each OR-ed into the mantissa
// of a power of two whose unit in the last place is 1 (f16 1024, fields < 1024; bf16 128, fields < 128). The bias
// stays in the operand: the products take it off afterwards through the other operand's sum (one subtraction a
// head, not one a code pair).
template <typename T>
constexpr float kCodeBias = std::is_same_v<T, __half> ? 1024.f : 128.f;

template <typename T>
__device__ __forceinline__ uint32_t codes_x2(uint32_t fields) {
  return fields | (std::is_same_v<T, __half> ? 0x64006400u : 0x43004300u);
}

template <typename T>
__device__ __forceinline__ float2 unpack_x2(uint32_t w) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h;
    memcpy(&h, &w, sizeof(w));
    return __half22float2(h);
  } else {
    __nv_bfloat162 h;
    memcpy(&h, &w, sizeof(w));
    return __bfloat1622float2(h);
  }
}

__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// The channel (within a thread's quarter of the head) at operand slot j of k-block kb, slots 0..3 being
// k = 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9: where key_pair reads it from. Q^T follows the same map.
template <int KBITS>
__device__ __forceinline__ int key_channel(int kb, int j) {
  if constexpr (KBITS == 8) return 4 * kb + j;
  return 8 * (kb / 2) + 2 * (kb % 2) + (j == 0 ? 0 : j == 1 ? 4 : j == 2 ? 1 : 5);
}

template <int KBITS>
constexpr float key_half() {
  return KBITS == 4 ? 7.5f : 3.f;
}

// One operand word of k-block kb from a token's key code words: half h = 0 holds slots 0, 1; h = 1 slots 2, 3.
template <int KBITS, int W>
__device__ __forceinline__ uint32_t key_pair(const uint32_t (&w)[W], int kb, int h) {
  if constexpr (KBITS == 8) return e4m3x2_f16x2(h == 0 ? w[kb] : w[kb] >> 16);
  const int e = 2 * (kb % 2) + h;  // field e and e + 4 of the 8-channel group kb / 2
  if constexpr (KBITS == 4) return codes_x2<__half>((w[kb / 2] >> (4 * e)) & kLowNibbles);
  const int bit = 24 * (kb / 2), word = bit / 32;  // 3-bit codes: eight in 24 bits, groups straddle words
  const uint32_t next = word + 1 < W ? w[word + 1] : 0u;
  const uint32_t g = __funnelshift_r(w[word], next, bit % 32) >> (3 * e);
  return codes_x2<__half>((g & 7u) | ((g << 4) & 0x70000u));
}

// Byte b of two tokens' value words, side by side at bytes 0 and 2: nibbles 0 / 1 of it are channel 2 b / 2 b + 1.
template <int W>
__device__ __forceinline__ uint32_t value_bytes(const uint32_t (&t0)[W], const uint32_t (&t1)[W], int b) {
  const int s = b % 4;
  return __byte_perm(t0[b / 4], t1[b / 4], s | ((4 + s) << 8));
}

template <int D, int KBITS>
struct Tile {
  using R = TcRows<D, KBITS>;
  uint32_t k[2][R::kKWords];  // key codes of tokens gid, gid + 8 (the thread's quarter)
  float ka[2], va[2];         // their key / value absmax
  uint32_t v[4][R::kVWords];  // value codes of tokens 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9 (the thread's eighth)
};

template <int D, int KBITS>
__device__ __forceinline__ void load_tile(Tile<D, KBITS>& t, const uint8_t* first_row, int64_t row_stride) {
  using R = TcRows<D, KBITS>;
  const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint8_t* row = first_row + (gid + 8 * r) * row_stride;
    load_words<R::kKWords, R::kKAlign>(t.k[r], row + tig * R::kKThread);
    if constexpr (KBITS != 8) t.ka[r] = load_f32(row + R::kCodeBytes);
    t.va[r] = load_f32(row + R::kKBytes + D / 2);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint8_t* row = first_row + (2 * tig + (c & 1) + 8 * (c >> 1)) * row_stride;
    load_words<R::kVWords, R::kVAlign>(t.v[c], row + R::kKBytes + gid * R::kVThread);
  }
}

// A warp's online softmax over its tiles, for the heads 2 tig, 2 tig + 1 of its score columns (log2 domain).
template <int D>
struct Softmax {
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, psum[2] = {0.f, 0.f};
  float acc[D / 16][4] = {};  // out^T m-tiles: rows gid / gid + 8 (channels), columns heads 2 tig, 2 tig + 1
};

// One tile of the warp's: scores on f16 operands, the value product on T's (bf16 activations keep P' = p * absmax
// / 7.5 in range for any absmax; f16 ones hold values of f16 range).
template <typename T, int D, int KBITS>
__device__ __forceinline__ void attend_tile(Softmax<D>& st, const Tile<D, KBITS>& t, const uint32_t (&qb)[D / 16][2],
                                            const float (&qoff)[2], bool live0, bool live1, float softcap) {
  constexpr int KB = D / 16;
  constexpr float kHalf = key_half<KBITS>();
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    const uint32_t a[4] = {key_pair<KBITS>(t.k[0], kb, 0), key_pair<KBITS>(t.k[1], kb, 0),
                           key_pair<KBITS>(t.k[0], kb, 1), key_pair<KBITS>(t.k[1], kb, 1)};
    mma_16816<__half>(s, a, qb[kb][0], qb[kb][1]);
  }
  float p[4];
  uint32_t packed[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float x[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float v = s[2 * r + h];
      if constexpr (KBITS != 8) v = t.ka[r] / kHalf * (v - qoff[h]);
      if (softcap > 0.f) v = softcap * tanhf(v / softcap);
      x[r] = (r == 0 ? live0 : live1) ? v * kLog2e : -INFINITY;
    }
    float mx = fmaxf(x[0], x[1]);
#pragma unroll
    for (int o = 4; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_new = fmaxf(st.m[h], mx);
    const bool none = m_new == -INFINITY;
    const float corr = none ? 1.f : exp2f(st.m[h] - m_new);
    st.m[h] = m_new;
    p[h] = none ? 0.f : exp2f(x[0] - m_new);
    p[2 + h] = none ? 0.f : exp2f(x[1] - m_new);
    st.l[h] = st.l[h] * corr + p[h] + p[2 + h];
    st.psum[h] *= corr;
#pragma unroll
    for (int mt = 0; mt < KB; ++mt) st.acc[mt][h] *= corr, st.acc[mt][2 + h] *= corr;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // P' of token gid + 8 r for both heads, rounded as the product sees it
    const float step = t.va[r] / 7.5f;
    const bool live = r == 0 ? live0 : live1;
    packed[r] = pack2<T>(live ? p[2 * r] * step : 0.f, live ? p[2 * r + 1] * step : 0.f);
    const float2 back = unpack_x2<T>(packed[r]);
    st.psum[0] += back.x, st.psum[1] += back.y;
  }
  const uint32_t b0 = transpose8x8(packed[0]), b1 = transpose8x8(packed[1]);  // P'^T: tokens 2 tig.. of head gid
#pragma unroll
  for (int mt = 0; mt < KB; ++mt) {
    const uint32_t lo = value_bytes(t.v[0], t.v[1], mt), hi = value_bytes(t.v[2], t.v[3], mt);
    const uint32_t a[4] = {codes_x2<T>(lo & kLowNibbles), codes_x2<T>((lo >> 4) & kLowNibbles),
                           codes_x2<T>(hi & kLowNibbles), codes_x2<T>((hi >> 4) & kLowNibbles)};
    mma_16816<T>(st.acc[mt], a, b0, b1);
  }
}

template <typename T, int D, int KBITS>
__global__ void __launch_bounds__(32 * kDecodeWarps)
    turbo_decode_tc_kernel(T* out, const T* q, int64_t q_stride, const uint8_t* cache, const int32_t* block_tables,
                           const int32_t* seq_lens, const float* signs, float* partials, int q_heads, int kv_heads,
                           int block_size, int max_blocks, int piece_unit, float scale, int sliding_window,
                           float softcap, float sqrt_d) {
  using R = TcRows<D, KBITS>;
  constexpr int E = D / 32, KB = D / 16;
  __shared__ __align__(16) float sm_q[kHeads][D];
  __shared__ float sm_qsum[kHeads];
  __shared__ float sm_m[kDecodeWarps][kHeads], sm_l[kDecodeWarps][kHeads];
  __shared__ __align__(16) float sm_acc[kDecodeWarps][kHeads][D + 4];  // padded: see the epilogue's stores
  pdl_wait();  // q, the step's new rows (and, in a mixed step, its gathered lengths) come from kernels before
  const turbo::DecodeCta<kHeads> cta(q_heads, kv_heads, seq_lens, piece_unit, sliding_window);
  if (cta.idle()) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  turbo::load_queries<T, E, kHeads, true>(sm_q, sm_qsum, q + cta.q_at(q_stride, q_heads, D), cta.heads, scale,
                                          KBITS != 8 ? signs : nullptr, sqrt_d);
  __syncthreads();
  uint32_t qb[KB][2];  // Q^T, the scores' B operand: head gid at the thread's slots of each k-block
  const float* my_q = sm_q[gid] + tig * (D / 4);
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    qb[kb][0] = pack2<__half>(my_q[key_channel<KBITS>(kb, 0)], my_q[key_channel<KBITS>(kb, 1)]);
    qb[kb][1] = pack2<__half>(my_q[key_channel<KBITS>(kb, 2)], my_q[key_channel<KBITS>(kb, 3)]);
  }
  constexpr float kKeyOffset = key_half<KBITS>() + kCodeBias<__half>;  // what each key operand holds over code - half
  const float qoff[2] = {kKeyOffset * sm_qsum[2 * tig], kKeyOffset * sm_qsum[2 * tig + 1]};
  const int32_t* table = block_tables + static_cast<int64_t>(cta.seq) * max_blocks;
  const int64_t row_stride = static_cast<int64_t>(kv_heads) * R::kRowBytes;
  auto first_row = [&](int t0) {  // tiles never cross a block (block_size % 16 == 0)
    const int64_t slot = static_cast<int64_t>(table[t0 / block_size]) * block_size + t0 % block_size;
    return cache + slot * row_stride + static_cast<int64_t>(cta.kvh) * R::kRowBytes;
  };
  Softmax<D> st;
  Tile<D, KBITS> cur, next;
  const int begin = (cta.lo & ~(kTile - 1)) + warp * kTile, stride = kDecodeWarps * kTile;
  if (begin < cta.hi) load_tile(cur, first_row(begin), row_stride);
  for (int t0 = begin; t0 < cta.hi; t0 += stride) {
    if (t0 + stride < cta.hi) load_tile(next, first_row(t0 + stride), row_stride);
    const int j0 = t0 + gid, j1 = j0 + 8;
    attend_tile<T>(st, cur, qb, qoff, j0 >= cta.lo && j0 < cta.hi, j1 >= cta.lo && j1 < cta.hi, softcap);
    cur = next;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int o = 4; o < 32; o *= 2) {
      st.l[h] += __shfl_xor_sync(0xffffffffu, st.l[h], o);
      st.psum[h] += __shfl_xor_sync(0xffffffffu, st.psum[h], o);
    }
  if (gid == 0)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sm_m[warp][2 * tig + h] = st.m[h] == -INFINITY ? -INFINITY : st.m[h] * kLn2;
      sm_l[warp][2 * tig + h] = st.l[h];
    }
  // Thread gid holds channels gid * D / 8 + 2 mt + (c >> 1) of heads 2 tig + (c & 1): 16-byte runs of its rows.
  // With rows of D + 4 floats a quarter warp's stores meet at most two to a bank.
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < KB / 2; ++j) {
      const float off = (7.5f + kCodeBias<T>) * st.psum[h];
      *reinterpret_cast<float4*>(&sm_acc[warp][2 * tig + h][gid * (D / 8) + 4 * j]) =
          make_float4(st.acc[2 * j][h] - off, st.acc[2 * j][2 + h] - off, st.acc[2 * j + 1][h] - off,
                      st.acc[2 * j + 1][2 + h] - off);
    }
  pdl_launch_dependents();  // the reduce or o_proj may start launching; it waits for this grid
  __syncthreads();
  turbo::merge_warps<T, E, kHeads>(out, partials, sm_m, sm_l, sm_acc, cta);
}

template <int D, int KBITS>
bool launch(const TurboDecodeArgs& a, DType dtype, dim3 grid, cudaStream_t stream) {
  if constexpr (!tc_takes<D, KBITS>()) {
    return false;
  } else {
    dispatch_float<false>(dtype, "turbo_decode_attention", [&](auto tag) {
      using T = decltype(tag);
      launch_pdl("turbo_decode_attention", turbo_decode_tc_kernel<T, D, KBITS>, grid, dim3(32 * kDecodeWarps), 0,
                 stream, static_cast<T*>(a.out), static_cast<const T*>(a.q), a.q_stride,
                 static_cast<const uint8_t*>(a.cache), a.block_tables, a.seq_lens, a.signs, a.partials, a.q_heads,
                 a.kv_heads, a.block_size, a.max_blocks, a.piece_unit, a.scale, a.sliding_window, a.softcap, a.sqrt_d);
    });
    return true;
  }
}

template <int D>
bool launch_bits(const TurboDecodeArgs& a, int k_bits, DType dtype, dim3 grid, cudaStream_t stream) {
  switch (k_bits) {
    case 8: return launch<D, 8>(a, dtype, grid, stream);
    case 4: return launch<D, 4>(a, dtype, grid, stream);
    case 3: return launch<D, 3>(a, dtype, grid, stream);
    default: return false;
  }
}

}  // namespace

bool turbo_decode_tc_takes(int64_t head_dim, int k_bits, int64_t block_size) {
  if (block_size % kTile != 0) return false;
  auto taken = [&](auto d) {
    constexpr int D = decltype(d)::value;
    if (k_bits == 8) return tc_takes<D, 8>();
    if (k_bits == 4) return tc_takes<D, 4>();
    return k_bits == 3 && tc_takes<D, 3>();
  };
  return head_dim == 64 ? taken(std::integral_constant<int, 64>{})
                        : head_dim == 128 && taken(std::integral_constant<int, 128>{});
}

bool turbo_decode_tc(const TurboDecodeArgs& a, int64_t num_seqs, int64_t parts, int head_dim, int k_bits, DType dtype,
                     std::uintptr_t stream) {
  if (!turbo_decode_tc_takes(head_dim, k_bits, a.block_size)) return false;
  const int chunks = (a.q_heads / a.kv_heads + kHeads - 1) / kHeads;
  const dim3 grid(static_cast<unsigned>(parts), static_cast<unsigned>(a.kv_heads * chunks),
                  static_cast<unsigned>(num_seqs));
  switch (head_dim) {
    case 64: return launch_bits<64>(a, k_bits, dtype, grid, as_stream(stream));
    case 128: return launch_bits<128>(a, k_bits, dtype, grid, as_stream(stream));
    default: return false;
  }
}

}  // namespace candle_vllm::cuda
