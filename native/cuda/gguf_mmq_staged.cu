// The int8 tensor-core GGUF product for decode batches of up to 8 tokens with its weights streamed through shared
// memory: y[M, N] = x[M, K] @ W[N, K]^T, x as the int8 codes and XBlocks of q8_activation.cuh.
//
// Why: gguf_mmq.cu's kernel keeps its weights in flight in registers, a unit or a few per warp, so at 1-8 tokens its
// one-wave grids wait on memory and stream the 8B shapes at 15-55 % of the H200's bandwidth (benches/RESULTS.md,
// session 20). Here the bytes in flight live in shared memory: a CTA owns 16 or 32 weight rows (layout() below), one
// warp only issues bulk copies of the rows' next chunks into a ring of stages (each row's chunk one contiguous copy,
// completing on the stage's mbarrier; a stage is refilled as soon as the multiplying warps release it), and 4 or 8
// warps multiply each stage as gguf_mmq.cu does (the same tile loaders, reading shared memory through
// gguf::StagedBytes, and the same unit arithmetic, gguf_mmq_multiply.cuh). Weights do not depend on the kernel
// before, so under programmatic dependent launch the ring fills while that kernel still runs; the codes are read
// only after waiting for it (by the multiplying warps, or by the copying warp where it stages them).
//
// With W multiplying warps (4 or 8: gguf_mmq.cu's rule or launch choice), warp w takes units w, w + W, ... of K as
// the register kernel's warps do, and the warps' sums meet in the same order, so a row's result equals that
// kernel's with the same warps, bit for bit (the tests compare them): which of the two a batch takes does not change
// a token's result.
// Rows sit kRowStride bytes apart in a stage, a stride of 4 (mod 8) words, so the 8 rows a warp's lanes read at once
// fall on distinct groups of 4 banks. A stage's row chunk is a multiple of 16 bytes (a bulk copy's granule) and of
// whole blocks for the half-block units, so a row's bytes keep their offsets mod 16 and the loaders' alignment rules
// hold; hence rows must be a multiple of 16 bytes long (gguf_mmq_staged_fits).
// Options per type and row length (layout() below): the tokens' codes and XBlocks of each chunk bulk-copied into
// the stage too (after the PDL wait), so no unit waits on a global load, or those of the whole of K copied once into
// shared memory beside the ring (in four pieces on their own barriers); where neither, each multiplying warp's tokens
// of its units of the next chunk held in registers while it multiplies this chunk's (holds_tokens(): UnitTokens, one
// stage of lookahead, so no mma waits on an L2 load); and the Q4_K/Q5_K min terms summed in two IMMA chains instead
// of one. None changes the bits.
#include <atomic>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/gguf_mmq_multiply.cuh"
#include "cuda/gguf_mmq_staged.h"
#include "cuda/mbarrier.cuh"
#include "cuda/smem_pipe.cuh"

namespace candle_vllm::cuda {
namespace {

constexpr int kMaxStages = 8;

// A loader's staging with W warps multiplying (one more issues the copies) and MT m-tiles of 16 rows: units per
// multiplying warp per stage (a row chunk of at least kChunkTarget bytes), the rows' stride, the stages (a ring of
// about kRingTarget bytes, and at least two stages: where kStagedTokens adds the chunk's token codes and XBlocks to
// each stage, the ring can exceed the target, e.g. Q6_K's long rows 2 x 48 KB for 16 KB).
template <class Q, int W, int MT, int kChunkTarget, int kRingTarget, bool kStagedTokens>
struct Staging {
  static constexpr int kThreads = (W + 1) * 32, kRows = 16 * MT;
  static constexpr bool fits(int u) {
    const int units = W * u, bytes = units * Q::kBlockBytes;
    return bytes % 16 == 0 && bytes >= kChunkTarget && (Q::kBlockElems != 128 || units % 2 == 0);
  }
  static constexpr int units_per_warp() {
    int u = 1;
    while (!fits(u)) ++u;
    return u;
  }
  static constexpr int kUnitsPerWarp = units_per_warp();
  static constexpr int kChunkUnits = W * kUnitsPerWarp;
  static constexpr int kChunkBytes = kChunkUnits * Q::kBlockBytes;
  static constexpr int kRowStride = kChunkBytes + ((kChunkBytes / 4) % 8 == 4 ? 0 : 16);
  static constexpr int kWeightBytes = kRows * kRowStride;
  // The stage's token codes: up to 8 tokens' codes of the chunk's elements, rows kTokenStride apart (8-byte lane
  // loads conflict-free per half warp at 8 (mod 32) words, the split lanes' 4-byte loads per warp at 4), then their
  // XBlocks, rows kBlockStride apart.
  static constexpr int kTokenElems = kChunkUnits * Q::kBlockElems;
  static constexpr int kTokenWords = Q::kSplitLanes ? 4 : 8;
  static constexpr int kTokenStride = kTokenElems + ((kTokenWords - (kTokenElems / 4) % 32 + 32) % 32) * 4;
  static constexpr int kBlockStride = kTokenElems / 4 + 16;
  static constexpr int kStageBytes = kWeightBytes + (kStagedTokens ? 8 * kTokenStride + 8 * kBlockStride : 0);
  static constexpr int kRingStages = kRingTarget / kStageBytes;
  static constexpr int kStages = kRingStages < 2 ? 2 : kRingStages > kMaxStages ? kMaxStages : kRingStages;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};

// With kResident the tokens' codes and XBlocks for the whole of K sit in shared memory after the ring, copied once
// after the PDL wait: code rows resident_stride(K, kTokenWords) bytes apart (kTokenWords (mod 32) words, as the
// stages' kTokenStride), then XBlock rows K / 4 + 16 bytes apart. Only narrow weights with short rows take it
// (layout()), which bounds the shared memory (launch()).
__host__ __device__ constexpr int resident_stride(int K, int words) {
  return K + ((words - (K / 4) % 32 + 32) % 32) * 4;
}

template <class Q, int W, int MT, int kChunk, int kRing, bool kStagedTokens, bool kSplitLow, bool kRope,
          bool kResident, bool kHold>
__global__ void __launch_bounds__(Staging<Q, W, MT, kChunk, kRing, kStagedTokens>::kThreads)
    gguf_mmq_staged_kernel(void* __restrict__ y, bool bf16, const int8_t* xq, const XBlock* xb,
                           const uint8_t* __restrict__ w, int M, int N, int K, int64_t row_bytes,
                           const GgufRopeCache rope) {
#ifdef CANDLE_VLLM_MBARRIER
  using S = Staging<Q, W, MT, kChunk, kRing, kStagedTokens>;
  static_assert(!(kResident && kStagedTokens), "the tokens are either resident or staged per chunk");
  static_assert(!kHold || !(kResident || kStagedTokens), "only tokens read from global memory are held");
  constexpr int kRows = S::kRows;
  extern __shared__ __align__(16) uint8_t ring[];
  // The resident tokens arrive in kResidentSegments pieces of whole chunks, each on its own barrier, so the
  // multiplying warps start on the first piece while the rest is in flight (q8_0 4096x4096 at 4 tokens: 10.39 us in
  // one piece, 9.24 in four; benches/RESULTS.md, session 25).
  constexpr int kResidentSegments = 4;
  __shared__ alignas(8) uint64_t full[S::kStages], empty[S::kStages], resident[kResidentSegments];
  uint8_t* const tok = ring + S::kSmemBytes;
  const int res_stride = resident_stride(K, S::kTokenWords), res_block_stride = K / 4 + 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = blockIdx.x * kRows, units = K / Q::kBlockElems;
  const int chunks = (units + S::kChunkUnits - 1) / S::kChunkUnits;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      mbar_init(smem_addr(&full[s]), kStagedTokens ? 2 : 1);  // the weights', then the tokens' (after the wait)
      mbar_init(smem_addr(&empty[s]), W);
    }
    if constexpr (kResident)
      for (int r = 0; r < kResidentSegments; ++r) mbar_init(smem_addr(&resident[r]), 1);
    mbar_fence_init();
  }
  __syncthreads();

  float acc[MT][1][4] = {};
  auto units_in = [&](int c) { return min(S::kChunkUnits, units - c * S::kChunkUnits); };
  const int seg_chunks = (chunks + kResidentSegments - 1) / kResidentSegments;
  auto stage_at = [&](int c) { return ring + (c % S::kStages) * S::kStageBytes; };
  if (warp == W) {
    // Lane r < kRows copies row r's chunks (rows past N copy the last row; their sums are dropped); lanes m and 8 + m
    // copy token m's codes and XBlocks (tokens past M are not copied: the readers take token M - 1 instead).
    const uint8_t* src = w + static_cast<int64_t>(min(row0 + lane, N - 1)) * row_bytes;
    auto weights = [&](int c) {
      const uint32_t bytes = units_in(c) * Q::kBlockBytes, bar = smem_addr(&full[c % S::kStages]);
      if (lane == 0) mbar_expect_tx(bar, kRows * bytes);
      __syncwarp();
      if (lane < kRows)
        bulk_copy(smem_addr(stage_at(c) + lane * S::kRowStride), src + static_cast<int64_t>(c) * S::kChunkBytes,
                  bytes, bar);
    };
    auto tokens = [&](int c) {
      const uint32_t elems = units_in(c) * Q::kBlockElems, bar = smem_addr(&full[c % S::kStages]);
      if (lane == 0) mbar_expect_tx(bar, M * (elems + elems / 4));
      __syncwarp();
      const int m = lane & 7;
      const int64_t e0 = static_cast<int64_t>(c) * S::kTokenElems;
      uint8_t* dst = stage_at(c) + S::kWeightBytes;
      if (lane < 8 && m < M)
        bulk_copy(smem_addr(dst + m * S::kTokenStride), xq + static_cast<int64_t>(m) * K + e0, elems, bar);
      else if (lane < 16 && m < M)
        bulk_copy(smem_addr(dst + 8 * S::kTokenStride + m * S::kBlockStride),
                  xb + static_cast<int64_t>(m) * (K / 32) + e0 / 32, elems / 4, bar);
    };
    const int first = min(S::kStages, chunks);
    for (int c = 0; c < first; ++c) weights(c);
    if constexpr (kStagedTokens) {
      pdl_wait();  // the codes are the kernel before's output, and y may still be read by it
      for (int c = 0; c < first; ++c) tokens(c);
    }
    if constexpr (kResident) {
      pdl_wait();
      const int m = lane & 7;
      for (int r = 0; r < kResidentSegments; ++r) {
        const int e0 = min(r * seg_chunks * S::kTokenElems, K), e1 = min((r + 1) * seg_chunks * S::kTokenElems, K);
        const uint32_t bar = smem_addr(&resident[r]), elems = e1 - e0;
        if (elems == 0) break;
        if (lane == 0) mbar_expect_tx(bar, M * (elems + elems / 4));
        __syncwarp();
        if (lane < 8 && m < M)
          bulk_copy(smem_addr(tok + m * res_stride + e0), xq + static_cast<int64_t>(m) * K + e0, elems, bar);
        else if (lane < 16 && m < M)
          bulk_copy(smem_addr(tok + M * res_stride + m * res_block_stride + e0 / 4),
                    xb + static_cast<int64_t>(m) * (K / 32) + e0 / 32, elems / 4, bar);
      }
    }
    for (int c = first; c < chunks; ++c) {
      mbar_wait(smem_addr(&empty[c % S::kStages]), (c / S::kStages - 1) & 1);
      weights(c);
      if constexpr (kStagedTokens) tokens(c);
    }
    // With no tokens to copy: wait before the store below writes y, which the kernel before may read.
    if constexpr (!kStagedTokens && !kResident) pdl_wait();
  } else {
    const int g = lane >> 2, t = lane & 3;
    TokenRows xg[1] = {};
    if constexpr (!kStagedTokens && !kResident) token_rows<Q>(xg, xq, xb, M, K, warp * Q::kBlockElems, g, t);
    pdl_wait();  // xq/xb (resident: their copies) are the kernel before's; y may still be read by it
    // kHold: held[i] holds the tokens of the warp's unit i of the chunk being multiplied (UnitTokens), and after its
    // use there those of unit i of the next chunk, which next_x points at.
    UnitTokens<Q> held[kHold ? S::kUnitsPerWarp : 1];
    TokenRows next_x = xg[0];
    auto hold = [&](int c, int i) {
      if (warp + W * i < units_in(c)) held[i].load(next_x.shifted(W * i * Q::kBlockElems));
    };
    if constexpr (kHold) {
#pragma unroll
      for (int i = 0; i < S::kUnitsPerWarp; ++i) hold(0, i);
      next_x.advance(S::kTokenElems);
    }
    for (int c = 0; c < chunks; ++c) {
      if constexpr (kResident)
        if (c % seg_chunks == 0) mbar_wait(smem_addr(&resident[c / seg_chunks]), 0);
      const int s = c % S::kStages;
      mbar_wait(smem_addr(&full[s]), (c / S::kStages) & 1);
      const int in_chunk = units_in(c);
      const uint8_t* stage = stage_at(c);
      const int lane_off = (Q::kSplitLanes ? 4 : 8) * t;
      const uint8_t* codes = kResident ? tok + min(g, M - 1) * res_stride + lane_off + c * S::kTokenElems
                                       : stage + S::kWeightBytes + min(g, M - 1) * S::kTokenStride + lane_off;
      const uint8_t* blocks = kResident ? tok + M * res_stride + c * (S::kTokenElems / 4)
                                        : stage + S::kWeightBytes + 8 * S::kTokenStride;
      const int block_stride = kResident ? res_block_stride : S::kBlockStride;
#pragma unroll
      for (int i = 0; i < S::kUnitsPerWarp; ++i) {
        const int u = warp + W * i;
        if (u < in_chunk) {
          Q q[MT][2];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r)
              q[mt][r].fetch(gguf::StagedBytes{stage + (16 * mt + 8 * r + g) * S::kRowStride}, u, t);
          if constexpr (kStagedTokens || kResident) {
            TokenRowsOf<true> x[1];
            x[0].codes = reinterpret_cast<const int8_t*>(codes) + u * Q::kBlockElems;
#pragma unroll
            for (int k = 0; k < 2; ++k)
              x[0].blocks[k] = reinterpret_cast<const XBlock*>(blocks + min(2 * t + k, M - 1) * block_stride) +
                               u * Q::kBlockElems / 32;
            multiply_any<Q, MT, 1, kSplitLow>(q, t, x, acc);
          } else if constexpr (kHold) {
            const UnitTokens<Q> x[1] = {held[i]};
            hold(c + 1, i);
            multiply_any<Q, MT, 1, kSplitLow>(q, t, x, acc);
          } else {
            multiply_any<Q, MT, 1, kSplitLow>(q, t, xg, acc);
            xg[0].advance(W * Q::kBlockElems);
          }
        }
      }
      if constexpr (kHold) next_x.advance(S::kTokenElems);
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty[s]));
    }
  }
  pdl_launch_dependents();
  store_rows<MT, 1, W, S::kThreads, kRope>(acc, y, bf16, row0, M, N, rope);
#else
  __trap();  // compiled for a GPU without bulk copies: staged_kernels_run() keeps launches away
#endif
}

// Whether the current device runs the staged kernels: a Hopper running the module's sm_90a code (wide_gemm.cu's
// rule). A later GPU would JIT-compile the module's compute_89 PTX, whose body is empty, so it keeps the register
// kernel.
bool staged_kernels_run() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device(cache, "gguf_mmq_staged", [](int dev) {
           int major = 0;
           check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "gguf_mmq_staged");
           cudaFuncAttributes attr{};
           auto probe = gguf_mmq_staged_kernel<mmq::MmqQ4K, 4, 1, 512, 16384, false, false, false, false, false>;
           check_cuda(cudaFuncGetAttributes(&attr, probe), "gguf_mmq_staged");
           return major == 9 && attr.binaryVersion == 90 ? 1 : 2;
         }) == 1;
}

// The staging per type and weight shape, measured on the H200 (session 21, calls 2 and 3; benches/RESULTS.md: us over
// 2, 4 and 8 tokens on the narrow 8B shapes (6144x4096, 4096x4096, 4096x14336) / the wide one (28672x4096), for
// m-tiles x chunk x ring of 1 x 1024 x 64K, 1 x 512 x 32K, 1 x 512 x 16K, 2 x 1024 x 64K, 2 x 512 x 32K):
//   q4k narrow 88 / 86 / 85 / 89 / 88, wide 97 / 86 / 85 / 99 / 78; q2k narrow 106 / 100 / 99 / 98 / 97, wide 112 /
//   87 / 86 / 110 / 76; q6k narrow 147 / 146 / 145 / 157 / 157, wide 138 / 137 / 135 / 155 / 156; q8_0 narrow 138 /
//   149 / 172 / 145 / 171, wide 156 / 145 / 140 / 148 / 133; q4_0 narrow 126 / 132 / 135 / 133 / 139, wide 138 / 110 /
//   121 / 125 / 112.
// So wide weights take two m-tiles (32 rows a CTA: a token load serves twice the rows), 512-byte chunks and a 32 KB
// ring, except the types whose half-block units hold the most per row (Q6_K, Q3_K: one m-tile and a 16 KB ring);
// narrow ones one m-tile, the K-quants 512-byte chunks in a 16 KB ring, the 32-element types 1 KB chunks in 64 KB.
// (Q5_K follows Q4_K, Q3_K Q6_K, the other 32-element types Q8_0 and Q4_0: not measured separately.) In every one
// the weights stream at 68-97 % of the copy ceiling when the warps only wait and release the stages (probe builds
// of call 3): the multiplying warps set the pace.
// The options, and two m-tiles in a 96 KB ring, against that (session 22, call 2: us summed over 2, 4 and 8 tokens,
// option / without, where they gained 7.5 % or more; elsewhere within 5 % either way, or slower):
//   - the tokens staged: q6k on 4096x14336 77 / 92, q4_0 there 55 / 67, q8_0 on the short narrow shapes 61 / 66
//     (slower by up to 36 % for q4k, q5k and q2k, by 7-15 % for q6k elsewhere);
//   - the min terms in two chains: q4k on 4096x14336 43 / 48, q5k 48 / 57 (q4k short narrow 9 % slower);
//   - q2k in 2 x 512 x 96K (4 stages of 22 KB) on 4096x14336 48 / 55 (q8_0 there 30 % slower).
// The four types left, the same way (session 23, call 4; the wide shape's sums 0.99-1.02 as the spread):
//   - the tokens staged: q4_1 on 4096x14336 56 / 85, q5_1 there 75 / 86 (q3k 29 % slower on the short shapes);
//   - 2 x 512 x 96K: q3k on 4096x14336 62 / 79, q5_0 there 70 / 94, q4_1 on the short narrow shapes 52 / 61 (q5_0
//     and q5_1 there 6-7 % faster, kept as they were).
//   (q4_1 and q5_1 narrow weights take the product from 5 rows since session 24: ops/quant.py MMQ_MIN_ROWS.)
// The tokens resident for the whole of K instead (session 24, call 3, every type's short narrow and wide shapes, 1-8
// tokens, two rounds): q8_0's short narrow rows 25.3 / 32.4 us on 4096x4096 and 35.4 / 40.7 on 6144x4096 over 2, 4
// and 8 tokens against its per-chunk staging; the other 32-element types at best 8 % faster on one shape and mostly
// slower, the K-quants 11-66 % slower on the short shapes (call 5 confirmed q8_0's in one build).
// Two m-tiles in a 96 KB ring with held tokens (holds_tokens) for the short narrow rows instead (session 37, call 4,
// on an H100: us summed over 2, 4 and 8 tokens on 6144x4096 / 4096x4096, two rounds within 1 %): q4_0 -16.7 / -16.0 %,
// q5_1 -10.9 / -20.6 %, q5_0 -0.2 / -16.8 %, q3k +1.7 / -12.7 %; q2k -4.3 / +0.6 %, q6k -3.2 / +0.9 %, q5k -8.3 /
// +10.4 %, q4k -2.0 / +13.4 % (kept as they were); on long rows q8_0 +22 %, q4k +7 %, q5k +9 %.
// Long rows (K >= kLongRowsK): the narrow shape whose layouts differ.
struct Layout {
  int m_tiles, chunk, ring;
  bool staged_tokens, split_low;
  bool resident_tokens = false;  // narrow short rows only (launch()'s shared-memory bound)
};
constexpr int kStagedWideRows = 16384;
constexpr int kLongRowsK = 8192;
enum class Shape { kNarrow, kNarrowLong, kWide };

template <class Q>
constexpr Layout layout(Shape shape) {
  constexpr bool kHeavyHalves = std::is_same_v<Q, mmq::MmqQ6K> || std::is_same_v<Q, mmq::MmqQ3K>;
  if (shape == Shape::kWide)
    return kHeavyHalves ? Layout{1, 512, 16384, false, false} : Layout{2, 512, 32768, false, false};
  constexpr Layout kDeepRing{2, 512, 98304, false, false};
  if (!Q::kUnitScales) {
    const bool long_rows = shape == Shape::kNarrowLong;
    if (std::is_same_v<Q, mmq::MmqQ5_0> || (!long_rows && !std::is_same_v<Q, mmq::MmqQ8_0>)) return kDeepRing;
    if (std::is_same_v<Q, mmq::MmqQ8_0> && !long_rows) return Layout{1, 1024, 65536, false, false, true};
    const bool staged = (std::is_same_v<Q, mmq::MmqQ4_0> || std::is_same_v<Q, mmq::MmqQ4_1> ||
                         std::is_same_v<Q, mmq::MmqQ5_1>) && long_rows;
    return Layout{1, 1024, 65536, staged, false};
  }
  if (shape == Shape::kNarrow)
    return std::is_same_v<Q, mmq::MmqQ3K> ? kDeepRing : Layout{1, 512, 16384, false, false};
  if (std::is_same_v<Q, mmq::MmqQ2K> || std::is_same_v<Q, mmq::MmqQ3K>) return kDeepRing;
  return Layout{1, 512, 16384, std::is_same_v<Q, mmq::MmqQ6K>,
                std::is_same_v<Q, mmq::MmqQ4K> || std::is_same_v<Q, mmq::MmqQ5K>};
}

// Whether the multiplying warps hold the next chunk's tokens in registers (kHold), where a layout reads them from
// global memory, measured on an H100 (session 37, call 1: bench_quant_cuda.py --kernels mmq --m 2 4 8 --codes with
// CANDLE_VLLM_STAGED_HOLD 1 and 0 in one build, two rounds, each within 2 % of the other except q2k): held, the wide
// shape gains 2-15 % at 2-8 tokens (q4_0 -8..-15 %, q5_1 -9..-13 %, q5_0 -4..-7 %, q4k -2..-5 %, q6k's 8 tokens -5 %),
// as do the two-m-tile deep rings (q4_1 short rows -5..-15 %, q3k long -5..-9 %, q5_0 long -6..-7 %) and q5k's long
// rows (-2 %); the one-m-tile short narrow rows lose up to 15 % (q4k 6144x4096 +10 %, q5_0 and q5_1 +3..+14 %), long
// rows of q4k, q8_0, q4_0 lose or tie, and q2k's (wide and long rows) and q3k's wide ones tie. So the short narrow
// rows of the types that take a deep ring there (layout(), call 4) hold them, the others not.
template <class Q>
constexpr bool holds_tokens(Shape shape) {
  using std::is_same_v;
  if (shape == Shape::kWide)
    return !is_same_v<Q, mmq::MmqQ2K> && !is_same_v<Q, mmq::MmqQ3K> && !is_same_v<Q, mmq::MmqQ8_0>;
  if (shape == Shape::kNarrow) return layout<Q>(shape).m_tiles == 2;
  return is_same_v<Q, mmq::MmqQ3K> || is_same_v<Q, mmq::MmqQ5_0> || is_same_v<Q, mmq::MmqQ5K>;
}

template <class Q, int W, int MT, int kChunk, int kRing, bool kStagedTokens, bool kSplitLow, bool kRope,
          bool kResident, bool kHold>
void launch(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
            const GgufRopeCache& rope, cudaStream_t s) {
  using S = Staging<Q, W, MT, kChunk, kRing, kStagedTokens>;
  auto kernel = gguf_mmq_staged_kernel<Q, W, MT, kChunk, kRing, kStagedTokens, kSplitLow, kRope, kResident, kHold>;
  // Resident tokens: up to kGgufMmqStagedMaxM rows of K < kLongRowsK (narrow short rows, layout()).
  constexpr int kMaxSmem =
      S::kSmemBytes +
      (kResident ? kGgufMmqStagedMaxM * (resident_stride(kLongRowsK, S::kTokenWords) + kLongRowsK / 4 + 16) : 0);
  static_assert(kMaxSmem <= 227 * 1024, "more shared memory than a Hopper CTA can have");
  static std::atomic<int> sized[kMaxDevices];  // more than 48 KB of dynamic shared memory, once per device
  per_device(sized, "gguf_mmq_staged", [&](int) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem),
               "gguf_mmq_staged: shared-memory limit");
    return 1;
  });
  const int smem = S::kSmemBytes + (kResident ? M * (resident_stride(K, S::kTokenWords) + K / 4 + 16) : 0);
  if (smem > kMaxSmem) throw std::invalid_argument("gguf_mmq_staged: resident tokens take rows shorter than 8192");
  const int64_t row_bytes = mmq::loader_row_bytes<Q>(K);
  launch_pdl(kRope ? "gguf_mmq_staged_rope_cache" : "gguf_mmq_staged", kernel, dim3((N + S::kRows - 1) / S::kRows),
             dim3(S::kThreads), smem, s, y, bf16, xq, xb, w, M, N, K, row_bytes, rope);
}

// Whether the layouts that hold their tokens (holds_tokens) do: CANDLE_VLLM_STAGED_HOLD=0 keeps the pointer form, for
// an A/B of the two in one build.
bool hold_tokens() {
  static const bool hold = env_switch_on("CANDLE_VLLM_STAGED_HOLD");
  return hold;
}

}  // namespace

bool gguf_mmq_staged_fits(int qtype, int M, int K) {
  bool rows_fit = false;
  const bool known = mmq::dispatch(qtype, [&](auto loader) {
    using Q = decltype(loader);
    // GGUF's row size a multiple of 16 bytes: a stage's whole-block chunks then hold whole groups of Q6_K's CUDA
    // layout too (8 blocks), and its rows keep GGUF's size.
    rows_fit = K % Q::kBlockElems == 0 && static_cast<int64_t>(K / Q::kBlockElems) * Q::kBlockBytes % 16 == 0;
  });
  return known && rows_fit && M >= 1 && M <= kGgufMmqStagedMaxM && staged_kernels_run();
}

void launch_gguf_mmq_staged(void* y, bool bf16, const int8_t* xq, const gguf::XBlock* xb, const uint8_t* w, int M,
                            int N, int K, int qtype, int warps, const GgufRopeCache* rope, cudaStream_t stream) {
  mmq::dispatch(qtype, [&](auto loader) {
    using Q = decltype(loader);
    const GgufRopeCache& r = rope != nullptr ? *rope : GgufRopeCache{};
    auto go = [&](auto w_tag, auto shape_tag) {
      constexpr int kW = decltype(w_tag)::value;
      constexpr Shape kShape = decltype(shape_tag)::value;
      constexpr Layout L = layout<Q>(kShape);
      // run_mmq admits K % 256 == 0 only, so the resident copies are whole 16-byte granules.
      using Resident = std::integral_constant<bool, L.resident_tokens>;
      auto with = [&](auto rope_tag, auto hold_tag) {
        launch<Q, kW, L.m_tiles, L.chunk, L.ring, L.staged_tokens, L.split_low, decltype(rope_tag)::value,
               Resident::value, decltype(hold_tag)::value>(y, bf16, xq, xb, w, M, N, K, r, stream);
      };
      auto held = [&](auto rope_tag) {
        constexpr bool kHeld = !L.staged_tokens && !L.resident_tokens && holds_tokens<Q>(kShape);
        if (kHeld && hold_tokens()) with(rope_tag, std::bool_constant<kHeld>{});
        else with(rope_tag, std::false_type{});
      };
      if (rope != nullptr) held(std::true_type{});
      else held(std::false_type{});
    };
    auto shaped = [&](auto w_tag) {
      using Wide = std::integral_constant<Shape, Shape::kWide>;
      using Long = std::integral_constant<Shape, Shape::kNarrowLong>;
      using Narrow = std::integral_constant<Shape, Shape::kNarrow>;
      if (N >= kStagedWideRows) go(w_tag, Wide{});
      else if (K >= kLongRowsK) go(w_tag, Long{});
      else go(w_tag, Narrow{});
    };
    if (warps == 8) shaped(std::integral_constant<int, 8>{});
    else shaped(std::integral_constant<int, 4>{});
  });
}

}  // namespace candle_vllm::cuda
