// GGUF (ggml) block basics shared by the CUDA decoders (gguf_decode.cuh) and the dp4a Parts (gguf_q8.cuh): the
// type codes, GGUF_HD (host + device), exact f32 arithmetic, unaligned little-endian loads and f16 scales.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define GGUF_HD __host__ __device__ __forceinline__
#else
#define GGUF_HD inline
#endif

namespace candle_vllm::gguf {

// gguf's GGMLQuantizationType values.
enum QType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int kUnitElems = 256;

// Block elements and GGUF bytes of a quantized type (0 for others).
GGUF_HD constexpr int block_elems(int qtype) {
  return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 ? 32
         : qtype >= Q2_K && qtype <= Q6_K                                                 ? 256
                                                                                          : 0;
}
GGUF_HD constexpr int block_bytes(int qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

// ---- Q6_K, Q3_K, Q8_0 and Q5_0 as the CUDA kernels store them ------------------------------------------------------
// GGUF's 210-byte Q6_K, 110-byte Q3_K, 34-byte Q8_0 and 22-byte Q5_0 blocks start 2 bytes off a word every other
// block, so a thread took a block's runs as word loads joined by funnel shifts (19 loads per row and part in Q6_K's
// one-token GEMV). Each block is a body of whole 16-byte runs (the codes) and a few small fields before or after it
// (Q6_K: 208 bytes of codes and scales, then its f16 d; Q3_K: 96 bytes of codes, then 12 scale bytes and its f16 d;
// Q8_0: its f16 d, then 32 codes; Q5_0: its f16 d and 32-bit qh, then 16 code bytes). On the GPU each row is kept in
// groups of 8 blocks instead: a header holding the 8 blocks' fields, each field as a plane of 8 (Q6_K and Q8_0: the 8
// d, 16 bytes; Q3_K: the 8 blocks' scales, 96 bytes, then their 8 d; Q5_0: the 8 d, then the 8 qh words), then the 8
// bodies, so every run is 16-byte aligned. A row's last group holds its remaining blocks behind a whole header (its
// unused slots zero). Groups are as long as 8 GGUF blocks, so rows keep GGUF's size when they are whole groups (K a
// multiple of 2048 for the K-quants, of 256 for the 32-element types). ops/cuda_gguf.py device_layout writes it.
// (Q4_0's 18-byte blocks on this layout lost 3-10 % at one token, session 29: they stay as GGUF has them.)
// Kernels address block b of a row at GGUF's position, row + B b (B: the GGUF block bytes). Rows and groups (8 B
// bytes) start 16-byte aligned, so that position's offset from a 16-byte boundary (misalign16: its low four bits,
// for global and staged pointers) is B (b % 8) mod 16, which tells b % 8 (slot), which is all it takes to find the
// block's bytes in its group.
template <int Q>
struct Grouped;  // a grouped type's body and header bytes, and b % 8 from its blocks' misalignment
template <>
struct Grouped<Q6_K> {  // 210 = 2 mod 16
  static constexpr int kBody = 208, kHeader = 16;
  GGUF_HD static constexpr int slot(int misalign) { return misalign >> 1; }
};
template <>
struct Grouped<Q3_K> {  // 110 = -2 mod 16
  static constexpr int kBody = 96, kHeader = 112;
  GGUF_HD static constexpr int slot(int misalign) { return ((16 - misalign) & 15) >> 1; }
};
template <>
struct Grouped<Q8_0> {  // 34 = 2 mod 16
  static constexpr int kBody = 32, kHeader = 16;
  GGUF_HD static constexpr int slot(int misalign) { return misalign >> 1; }
};
template <>
struct Grouped<Q5_0> {  // 22 = 6 mod 16, and 3 x 3 = 1 mod 8
  static constexpr int kBody = 16, kHeader = 48;
  GGUF_HD static constexpr int slot(int misalign) { return (3 * (misalign >> 1)) & 7; }
};
constexpr int kGroupBlocks = 8;

template <int Q>
constexpr int kGroupBytes = Grouped<Q>::kHeader + kGroupBlocks * Grouped<Q>::kBody;

template <int Q>
GGUF_HD constexpr int64_t grouped_row_bytes(int64_t K) {
  using G = Grouped<Q>;
  const int64_t blocks = K / block_elems(Q), tail = blocks % kGroupBlocks;
  return blocks / kGroupBlocks * kGroupBytes<Q> + (tail != 0 ? G::kHeader + G::kBody * tail : 0);
}

GGUF_HD int misalign16(const uint8_t* p) { return static_cast<int>(reinterpret_cast<std::uintptr_t>(p) & 15); }

// A header plane: its offset in the group and its bytes per block. Q6_K's d; Q3_K's 12 scale bytes (4-byte aligned)
// and d; the d of Q8_0 and Q5_0, and Q5_0's qh (4-byte aligned). The bodies: Q6_K's ql at 0, qh at 128, scales at
// 192; Q3_K's hmask at 0, qs at 32; the 32-element types' codes.
struct Field {
  int plane, width;
};
constexpr Field kQ6KD{0, 2}, kQ3KScales{0, 12}, kQ3KD{96, 2}, kBlock32D{0, 2}, kQ5_0Qh{16, 4};

// From block b's GGUF position p: its body, and its slot of a header plane.
template <int Q, class P>
GGUF_HD P grouped_body(P p) {
  using G = Grouped<Q>;
  const int j = G::slot(misalign16(p));
  return p - (block_bytes(Q) - G::kBody) * j + G::kHeader;
}
template <int Q, class P>
GGUF_HD P grouped_field(P p, Field f) {
  using G = Grouped<Q>;
  const int j = G::slot(misalign16(p));
  return p - (block_bytes(Q) - f.width) * j + f.plane;
}

// The same from a row (or a stretch of whole groups) and the block's index b in it, for code that knows b: no address
// bits to decode (the tile loaders: ptxas gave the staged product's Q5_0 loop 4-8 % more instructions finding the
// blocks by misalign16).
template <int Q, class P>
GGUF_HD P grouped_body_at(P row, int b) {
  using G = Grouped<Q>;
  return row + static_cast<int64_t>(b >> 3) * kGroupBytes<Q> + (G::kHeader + G::kBody * (b & 7));
}
template <int Q, class P>
GGUF_HD P grouped_field_at(P row, int b, Field f) {
  return row + static_cast<int64_t>(b >> 3) * kGroupBytes<Q> + (f.plane + f.width * (b & 7));
}

// The bytes of one K-element row as the CUDA kernels store it.
GGUF_HD constexpr int64_t row_bytes(int qtype, int64_t K) {
  switch (qtype) {
    case Q6_K: return grouped_row_bytes<Q6_K>(K);
    case Q3_K: return grouped_row_bytes<Q3_K>(K);
    case Q8_0: return grouped_row_bytes<Q8_0>(K);
    case Q5_0: return grouped_row_bytes<Q5_0>(K);
    default: break;
  }
  const int elems = block_elems(qtype);
  return elems == 0 ? 0 : K / elems * block_bytes(qtype);
}

// Whether every row of the type starts 16-byte aligned as the CUDA kernels store it, for any K (the tensor itself
// aligned): the grouped types, and Q4_K and Q5_K, whose 144- and 176-byte blocks are whole 16-byte runs.
GGUF_HD constexpr bool rows_aligned16(int qtype) {
  return qtype == Q6_K || qtype == Q3_K || qtype == Q8_0 || qtype == Q5_0 || qtype == Q4_K || qtype == Q5_K;
}

// ---- exact f32 helpers (no FMA contraction, even under --use_fast_math) --------------------------------------

GGUF_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GGUF_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GGUF_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

GGUF_HD uint32_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
// A 32-bit word at a 2-byte aligned address.
GGUF_HD uint32_t ld32(const uint8_t* p) { return ld16(p) | (ld16(p + 2) << 16); }

GGUF_HD float f16(const uint8_t* p) {
  const uint32_t h = ld16(p);
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&v, &bits, 4);
  return v;
#endif
}

// Bytes k and k+1 of v moved to bytes 0 and 2 (the two halves of a packed pair).
GGUF_HD uint32_t spread(uint32_t v, int k) {
#ifdef __CUDA_ARCH__
  return __byte_perm(v, 0, k == 0 ? 0x4140 : 0x4342);
#else
  return ((v >> (8 * k)) & 0xFF) | (((v >> (8 * k + 8)) & 0xFF) << 16);
#endif
}

constexpr uint32_t kLo4 = 0x000F000F, kLo2 = 0x00030003, kLo1 = 0x00010001;

// A type's decoder (gguf_decode_block32.cuh, gguf_decode_kquants.cuh; the contract is in gguf_decode.cuh).
template <int Q>
struct Deq;

}  // namespace candle_vllm::gguf
