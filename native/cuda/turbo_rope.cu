// RoPE on q and k and the TurboQuant cache write of k and v in one launch: what rotary.cu's RoPE + cache kernel is
// for dense caches. A warp takes a head of one token, or two q heads (E = D / 32 consecutive channels a lane, the
// rows' layout), so a neox partner sits 16 lanes away and a gptj partner in the same lane. Each value is rotated in f32 and
// rounded to T as rotary.cu stores it, so the rows equal those of the rotary kernel followed by turbo_kv.cu's
// write. q comes out rotated, k and v as their rows decode to (K turned back): what a dense attention over the
// step's own K/V must see. With a deferred norm (deferred_norm.h) each CTA first computes its token's 1/rms and
// scales q, k and v by it (v in place too); its reduction is the CTA's, not rotary.cu's per-warp one, so the scale
// may differ from that kernel's in the last bit.
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/deferred_norm.cuh"
#include "cuda/rotary.h"
#include "cuda/turbo_encode.cuh"
#include "cuda/turbo_kv.h"

namespace candle_vllm::cuda {
namespace {

using turbo::encode_k;
using turbo::encode_v;
using turbo::load_run;
using turbo::RowLayout;
using turbo::store_lane;

constexpr int kRopeWarps = 8;

// Where standard channel c of a head sits when its halves are stored interleaved in groups of g channels (g 0: the
// standard layout): first-half channels g*j.. then their partners half+g*j.., pair group after pair group.
__device__ __forceinline__ int stored_at(int c, int half, int g) {
  if (g == 0) return c;
  const int i = c < half ? c : c - half;
  return i / g * 2 * g + (c < half ? 0 : g) + i % g;
}

// A head's values as the lane reads them: its E channels of the standard layout, wherever the pair group put them.
template <typename T, int E>
__device__ __forceinline__ void load_head(T (&raw)[E], const T* head, int pair_group) {
  constexpr int kHalf = 16 * E;
  const int lane = threadIdx.x & 31;
  if (pair_group % E == 0) {  // the lane's channels stored side by side
    load_run(raw, head + stored_at(lane * E, kHalf, pair_group));
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) raw[e] = head[stored_at(lane * E + e, kHalf, pair_group)];
  }
}

// raw * scale turned by the lane's cos/sin and rounded to T, as rotary.cu rounds it.
template <typename T, int E>
__device__ __forceinline__ void rotated(float (&x)[E], const T (&raw)[E], float scale, const T (&c)[E],
                                        const T (&s)[E], bool neox) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = to_f32(raw[e]) * scale;
  if (neox) {
    float partner[E];
#pragma unroll
    for (int e = 0; e < E; ++e) partner[e] = __shfl_xor_sync(0xffffffffu, x[e], 16);
#pragma unroll
    for (int e = 0; e < E; ++e)
      x[e] = lane < 16 ? rope_pair(x[e], partner[e], to_f32(c[e]), to_f32(s[e])).x
                       : rope_pair(partner[e], x[e], to_f32(c[e]), to_f32(s[e])).y;
  } else {
#pragma unroll
    for (int e = 0; e < E; e += 2) {
      const float2 r = rope_pair(x[e], x[e + 1], to_f32(c[e]), to_f32(s[e]));
      x[e] = r.x;
      x[e + 1] = r.y;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = round_to<T>(x[e]);
}

// Grid (ceil((ceil(Hq / 2) + 2 Hk) / kRopeWarps), tokens). Warp w of CTA x takes role r = x * kRopeWarps + w: two q
// heads (r and r + ceil(Hq / 2)), a k head or a v head. A kv head's two codings run side by side, and a q head's
// rotation, far shorter than a coding, shares its warp: a 64-token step's CTAs fit one wave at this kernel's
// registers.
template <typename T, int E>
__global__ void __launch_bounds__(32 * kRopeWarps) turbo_rope_kernel(const TurboRopeArgs a) {
  constexpr int D = 32 * E, kHalf = D / 2;
  pdl_launch_dependents();
  const int64_t t = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int r = static_cast<int>(blockIdx.x) * kRopeWarps + static_cast<int>(threadIdx.x / 32);
  const bool neox = a.style != kRopeGptj;
  // Positions, slots and the cos/sin table are inputs of the step, not outputs of the kernel before. A lane's
  // cos/sin, rounded to T as rotary.cu rounds them: E consecutive angles (neox: its channels' place in their half),
  // or E / 2 each twice (gptj).
  T c[E], s[E];
  {
    const float* cs = a.cos_sin + a.positions[t] * D;
    constexpr int kAngles = E / 2;
    float cf[E], sf[E];
    if (neox) {
      load_run(cf, cs + lane * E % kHalf);
      load_run(sf, cs + kHalf + lane * E % kHalf);
    } else {
      float ch[kAngles], sh[kAngles];
      load_run(ch, cs + lane * kAngles);
      load_run(sh, cs + kHalf + lane * kAngles);
#pragma unroll
      for (int e = 0; e < E; ++e) cf[e] = ch[e / 2], sf[e] = sh[e / 2];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) c[e] = from_f32<T>(cf[e]), s[e] = from_f32<T>(sf[e]);
  }
  const int64_t slot = a.slots[t];
  // The deferred norm's scale before the wait, while the GEMM before still runs (deferred_norm.h).
  const bool norm_early = a.norm.rows != nullptr && a.norm.before_wait;
  float scale = norm_early ? block_inv_rms<T>(a.norm, t) : 1.f;
  pdl_wait();
  const int q_warps = (a.q_heads + 1) / 2;
  const bool is_q = r < q_warps, is_v = r >= q_warps + a.k_heads, live = r < q_warps + 2 * a.k_heads;
  const bool second = is_q && r + q_warps < a.q_heads;
  const int hk = is_v ? r - q_warps - a.k_heads : r - q_warps;
  T* head = is_q   ? static_cast<T*>(a.q) + t * a.q_stride + static_cast<int64_t>(r) * D
            : is_v ? static_cast<T*>(a.v) + t * a.v_stride + static_cast<int64_t>(hk) * D
                   : static_cast<T*>(a.k) + t * a.k_stride + static_cast<int64_t>(hk) * D;
  T* head2 = head + static_cast<int64_t>(q_warps) * D;
  T raw[E], raw2[E];
  if (live) {
    if (is_v) load_run(raw, head + lane * E);
    else load_head(raw, head, a.pair_group);
    if (second) load_head(raw2, head2, a.pair_group);
  }
  if (a.norm.rows != nullptr && !norm_early) scale = block_inv_rms<T>(a.norm, t);
  if (!live) return;
  const RowLayout L(D, a.k_bits);
  uint8_t* row = !is_q && slot >= 0 ? a.cache + (slot * a.k_heads + hk) * L.row_bytes : nullptr;
  float x[E];
  if (is_v) {
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = round_to<T>(to_f32(raw[e]) * scale);
    if (row != nullptr) encode_v(x, row, L, true);
    store_lane(head, x);
    return;
  }
  rotated(x, raw, scale, c, s, neox);
  __syncwarp();  // a paired head: every lane has read it before any lane writes it back in the standard layout
  if (row != nullptr) encode_k(x, row, L, a.k_bits, a.signs, a.sqrt_d, true);
  store_lane(head, x);
  if (second) {
    rotated(x, raw2, scale, c, s, neox);
    store_lane(head2, x);
  }
}

}  // namespace

void turbo_rope_cache_write(const TurboRopeArgs& args, int64_t head_dim, DType dtype, std::uintptr_t stream) {
  const char* what = "turbo_rope_cache_write";
  turbo::check_bits(args.k_bits, what);
  if (args.tokens == 0) return;
  if (args.tokens > 65535 || args.q_heads < 1 || args.k_heads < 1)
    throw std::invalid_argument(std::string(what) + ": 1-65535 tokens, at least one q and one kv head");
  if (args.pair_group != 0 && (args.style == kRopeGptj || (args.pair_group != 1 && args.pair_group != 8)))
    throw std::invalid_argument(std::string(what) + ": pair groups of 1 or 8 channels, neox heads only");
  check_deferred_norm(what, args.norm, 2);
  TurboRopeArgs a = args;
  a.norm = for_launch(args.norm);
  dispatch_float<false>(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    turbo::dispatch_lanes(head_dim, what, [&](auto e) {
      const int64_t roles = (args.q_heads + 1) / 2 + 2 * args.k_heads;
      const dim3 grid(static_cast<unsigned>((roles + kRopeWarps - 1) / kRopeWarps), static_cast<unsigned>(args.tokens));
      launch_pdl(what, turbo_rope_kernel<T, decltype(e)::value>, grid, dim3(32 * kRopeWarps), 0, as_stream(stream),
                 a);
    });
  });
}

}  // namespace candle_vllm::cuda
