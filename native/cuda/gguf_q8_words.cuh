// Loading and unpacking for the dp4a GGUF Parts (gguf_q8.cuh): dp4a with host fallbacks, the read-only weight
// loads, 2-byte-aligned words, f16 scales, and the int8 activation words (XWords) a Part's dot() multiplies.
#pragma once
#include <cstdint>
#include <cstring>

#ifndef __CUDACC__
#include <vector_types.h>
#endif

#include "cuda/gguf_block.cuh"
#include "cuda/q8_activation.cuh"

namespace candle_vllm::gguf {

constexpr uint32_t kNib = 0x0F0F0F0Fu;

GGUF_HD int dp4a(uint32_t a, uint32_t b, int c) {
#ifdef __CUDA_ARCH__
  return __dp4a(static_cast<int>(a), static_cast<int>(b), c);
#else
  for (int i = 0; i < 4; ++i)
    c += static_cast<int8_t>(a >> (8 * i)) * static_cast<int8_t>(b >> (8 * i));
  return c;
#endif
}

// The same with a's bytes unsigned (0..255): a high nibble kept in place (16 x code) is one mask, no shift.
GGUF_HD int dp4a_us(uint32_t a, uint32_t b, int c) {
#ifdef __CUDA_ARCH__
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  for (int i = 0; i < 4; ++i)
    c += static_cast<int>((a >> (8 * i)) & 0xFF) * static_cast<int8_t>(b >> (8 * i));
  return c;
#endif
}

// __dp2a_lo / __dp2a_hi (kHi): a's two int16 times bytes 0, 1 (or 2, 3) of b as int8, plus c.
template <bool kHi>
GGUF_HD int dp2a(int a, int b, int c) {
#ifdef __CUDA_ARCH__
  if constexpr (kHi) return __dp2a_hi(a, b, c);
  else return __dp2a_lo(a, b, c);
#else
  const int bb = kHi ? b >> 16 : b;
  return c + static_cast<int16_t>(a & 0xFFFF) * static_cast<int8_t>(bb) +
         static_cast<int16_t>(static_cast<uint32_t>(a) >> 16) * static_cast<int8_t>(bb >> 8);
#endif
}

// __byte_perm: byte i of the result is byte (s >> 4i) & 7 of (y:x). The intrinsic reads three bits of each selector:
// it has no sign mode, unlike PTX's prmt (session 35: a selector that counted on one broke Q6_K on the GPU only).
GGUF_HD uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, s);
#else
  const uint64_t v = static_cast<uint64_t>(y) << 32 | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>(v >> (8 * ((s >> (4 * i)) & 7)) & 0xFF) << (8 * i);
  return r;
#endif
}

// The f32 whose bits are u.
GGUF_HD float as_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Bits 32..63 of (hi:lo) >> 16.
GGUF_HD uint32_t mid16(uint32_t lo, uint32_t hi) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, 16);
#else
  return (lo >> 16) | (hi << 16);
#endif
}

// A V of the quantized activations at p. The quantizer that writes them may still run when the GEMV starts
// (programmatic dependent launch), so these are ordinary cached loads issued after griddepcontrol.wait, never
// the read-only path (.nc), which assumes the data is constant for the GEMV's whole lifetime.
template <typename V>
GGUF_HD V ld_x(const void* p) {
#ifdef __CUDA_ARCH__
  return __ldca(static_cast<const V*>(p));
#else
  return *static_cast<const V*>(p);
#endif
}

// A V of the weights (immutable: the read-only path).
template <typename V>
GGUF_HD V ld(const void* p) {
#ifdef __CUDA_ARCH__
  return __ldg(static_cast<const V*>(p));
#else
  return *static_cast<const V*>(p);
#endif
}

// Weight bytes a kernel staged in shared memory (the streamed tensor-core product): the tile loaders take it where
// they take a global row pointer, and ld() then reads with plain loads (the read-only path is global memory only).
// The staging keeps each byte's offset from a 16-byte boundary, so the loaders' alignment rules hold unchanged.
struct StagedBytes {
  const uint8_t* p;
  GGUF_HD StagedBytes operator+(int64_t n) const { return {p + n}; }
};

template <typename V>
GGUF_HD V ld(StagedBytes s) {
  return *reinterpret_cast<const V*>(s.p);
}

GGUF_HD bool odd_half(const uint8_t* p) { return (reinterpret_cast<std::uintptr_t>(p) & 2) != 0; }

// The aligned words holding bytes [p, p + 4N) of a 2-byte aligned p (N + 1 when p is not 4-byte aligned; the last
// one then holds only the final two bytes, read by a 16-bit load so nothing past p + 4N is read: at a tensor's last
// block that would be past its end).
template <int N>
struct A2Words {
  uint32_t w[N + 1];
  bool odd;  // p % 4 == 2: the bytes straddle w[0..N]
};

template <int N, class P>
GGUF_HD void fetch_a2(A2Words<N>& raw, P p) {
  const bool odd = odd_half(p);
  const P a = p - (odd ? 2 : 0);
#pragma unroll
  for (int i = 0; i < N; ++i) raw.w[i] = ld<uint32_t>(a + 4 * i);
  raw.w[N] = odd ? ld<uint16_t>(a + 4 * N) : 0u;  // mid16 takes only its low half
  raw.odd = odd;
}

// Bytes [p, p + 4N) as N words from the fetched aligned words.
template <int N>
GGUF_HD void words_a2(const A2Words<N>& raw, uint32_t (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = raw.odd ? mid16(raw.w[i], raw.w[i + 1]) : raw.w[i];
}

GGUF_HD float half_lo(uint32_t w) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFF)));
#else
  const uint8_t b[2] = {static_cast<uint8_t>(w), static_cast<uint8_t>(w >> 8)};
  return f16(b);
#endif
}
GGUF_HD float half_hi(uint32_t w) { return half_lo(w >> 16); }

// The f16 at a 2-byte aligned p (its bits in the low half; one 16-bit load, so a block's d never reads past the
// tensor's last byte), and that f16 as f32.
template <class P>
GGUF_HD uint32_t fetch_f16_a2(P p) {
  return ld<uint16_t>(p);
}
GGUF_HD float f16_a2(uint32_t w) { return half_lo(w); }

// Bit 4 of byte j = bit j of the low 4 bits of n (the fifth bit of 4 adjacent 5-bit codes).
GGUF_HD uint32_t bit4_of_bytes(uint32_t n) { return ((n & 0xF) * 0x00204081u & 0x01010101u) << 4; }

// Activation words and scales for one Part: kPieces pieces of kWords words, each piece in one 32-element block.
template <int kPieces, int kWords>
struct XWords {
  uint32_t q[kPieces][kWords];
  float d[kPieces];
  int sum[kPieces];
};

GGUF_HD void ld_x_words(const int8_t* p, uint32_t* out, int words) {
  if (words == 4) {
    const uint4 v = ld_x<uint4>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  } else if (words == 8) {
    const uint4 a = ld_x<uint4>(p), b = ld_x<uint4>(p + 16);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    const uint2 v = ld_x<uint2>(p);
    out[0] = v.x, out[1] = v.y;
  }
}

// Piece i of X: kWords words at element e of the row (e within 32-element block e / 32); half: which 16-element
// half's code sum to keep (-1: both).
template <int P, int W>
GGUF_HD void ld_x_piece(XWords<P, W>& x, int i, const int8_t* xq, const XBlock* xb, int e, int half) {
  ld_x_words(xq + e, x.q[i], W);
  const uint2 b = ld_x<uint2>(xb + e / 32);  // an XBlock
  const int s0 = static_cast<int16_t>(b.y & 0xFFFF), s1 = static_cast<int16_t>(b.y >> 16);
  x.d[i] = as_float(b.x);
  x.sum[i] = half < 0 ? s0 + s1 : half == 0 ? s0 : s1;
}

// A type's Part (gguf_q8_block32.cuh, gguf_q8_k16.cuh, gguf_q8_kquants.cuh; the contract is in gguf_q8.cuh).
template <int Q>
struct Q8Dot;

}  // namespace candle_vllm::gguf
