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

// ---- Q6_K as the CUDA kernels store it ----------------------------------------------------------------------------
// GGUF's 210-byte Q6_K blocks start 2 bytes off a word every other block, so a thread took a block's 16-byte runs as
// word loads joined by funnel shifts (19 loads per row and part in the one-token GEMV). On the GPU each row is kept
// in groups of 8 blocks instead: the 8 blocks' f16 d (16 bytes), then their other 208 bytes each (ql, qh and the
// scales at their GGUF offsets), so every run is 16-byte aligned. A row's last group holds its nb % 8 remaining
// blocks (16 + 208 (nb % 8) bytes, the header's unused slots zero). Rows are whole multiples of 16 bytes, and the
// same size as GGUF's when K is a multiple of 2048. ops/cuda_gguf.py device_layout writes it.
// Kernels address block b of a row at GGUF's position, row + 210 b. Rows start 16-byte aligned, so that position is
// 2 (b % 8) bytes past a 16-byte boundary, which is all it takes to find the block's bytes in its group:
// q6k_body / q6k_d below (misalign16: those low four bits, for global and staged pointers).
constexpr int kQ6KGroup = 8, kQ6KGroupBytes = 16 + 8 * 208;

GGUF_HD constexpr int64_t q6k_row_bytes(int64_t K) {
  const int64_t blocks = K / 256, tail = blocks % kQ6KGroup;
  return blocks / kQ6KGroup * kQ6KGroupBytes + (tail != 0 ? 16 + 208 * tail : 0);
}

GGUF_HD int misalign16(const uint8_t* p) { return static_cast<int>(reinterpret_cast<std::uintptr_t>(p) & 15); }

// The block's 208 bytes (ql at 0, qh at 128, scales at 192) and its f16 d, from its GGUF position p.
template <class P>
GGUF_HD P q6k_body(P p) {
  return p - misalign16(p) + 16;
}
template <class P>
GGUF_HD P q6k_d(P p) {
  return p - 104 * misalign16(p);  // the group's start + 2 (b % 8)
}

// Block elements and GGUF bytes of a quantized type (0 for others), and the bytes of one K-element row as the CUDA
// kernels store it.
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
GGUF_HD constexpr int64_t row_bytes(int qtype, int64_t K) {
  if (qtype == Q6_K) return q6k_row_bytes(K);
  const int elems = block_elems(qtype);
  return elems == 0 ? 0 : K / elems * block_bytes(qtype);
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
