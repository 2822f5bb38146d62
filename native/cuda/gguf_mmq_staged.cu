// The int8 tensor-core GGUF product for decode batches of up to 8 tokens with its weights streamed through shared
// memory: y[M, N] = x[M, K] @ W[N, K]^T, x as the int8 codes and XBlocks of q8_activation.cuh.
//
// Why: gguf_mmq.cu's kernel keeps its weights in flight in registers, a unit or a few per warp, so at 1-8 tokens its
// one-wave grids wait on memory and stream the 8B shapes at 15-55 % of the H200's bandwidth (benches/RESULTS.md,
// session 20). Here the bytes in flight live in shared memory: a CTA owns 16 or 32 weight rows (layout(),
// gguf_mmq_staged_layout.cuh), one warp only issues bulk copies of the rows' next chunks into a ring of stages (each
// row's chunk one contiguous copy, completing on the stage's mbarrier; a stage is refilled as soon as the multiplying
// warps release it), and 4, 8 or 16 warps multiply each stage as gguf_mmq.cu does (the same tile loaders, reading
// shared memory through gguf::StagedBytes, and the same unit arithmetic, gguf_mmq_multiply.cuh). Weights do not
// depend on the kernel before, so under programmatic dependent launch the ring fills while that kernel still runs; the
// codes are read only after waiting for it (by the multiplying warps, or by the copying warp where it stages them).
// With W multiplying warps (4, 8 or 16: gguf_mmq.cu's staged_warps or a launch choice), warp w takes units w, w + W,
// ... of K as the register kernel's warps do, and the warps' sums meet in the same order, so a row's result equals
// that kernel's with the same warps, bit for bit (the tests compare them). Where staged_warps gives 16 and the
// register kernel's rule 8 or 4, which of the two a batch takes changes a token's f32 rounding.
// Rows sit kRowStride bytes apart in a stage, a stride of 4 (mod 8) words, so the 8 rows a warp's lanes read at once
// fall on distinct groups of 4 banks. A stage's row chunk is a multiple of 16 bytes (a bulk copy's granule) and of
// whole blocks for the half-block units, so a row's bytes keep their offsets mod 16 and the loaders' alignment rules
// hold; hence rows must be a multiple of 16 bytes long (gguf_mmq_staged_fits).
// Options per type and row length (layout(), gguf_mmq_staged_layout.cuh): the tokens' codes and XBlocks of each chunk
// bulk-copied into the stage too (after the PDL wait), so no unit waits on a global load; where not, each multiplying
// warp's tokens of its units of a chunk loaded into registers (UnitTokens) just before it waits for the chunk's
// weights, so their L2 latency overlaps that wait (prefetches_tokens(): all but Q2_K's short rows and wide weights,
// which read them through pointers as they multiply); and the Q4_K/Q5_K min terms summed in two IMMA chains instead
// of one. None changes the bits.
#include <atomic>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/gguf_mmq_multiply.cuh"
#include "cuda/gguf_mmq_staged.h"
#include "cuda/gguf_mmq_staged_layout.cuh"
#include "cuda/mbarrier.cuh"
#include "cuda/smem_pipe.cuh"

namespace candle_vllm::cuda {
namespace {

constexpr int kMaxStages = 8;

// benches/probe_mmq_parts.cu builds the kernel with one part left out to time the others: 1 no multiplying, 2 no
// token loads, 4 no store (nor the trigger before it).
#ifndef MMQ_STAGED_PROBE
#define MMQ_STAGED_PROBE 0
#endif
constexpr int kProbe = MMQ_STAGED_PROBE;

// Its timeline builds (MMQ_STAGED_PROBE_TIMELINE) record, in lane 0 of warp 0 of the first kTimelineCtas CTAs, the
// SM clock at the CTA's start, as each of its first 32 chunks' weights are seen landed, after its last multiply and
// when its wait for the kernel before ended, for probe_timeline() to read back: when the stages arrive and how much
// multiplying is left after the last one. Slots: 0 the start, 1 + c chunk c (c < 32), 33 the end, 34 the wait's end.
#ifdef MMQ_STAGED_PROBE_TIMELINE
constexpr int kTimelineCtas = 1024, kTimelineSlots = 35;
__device__ long long g_timeline[kTimelineCtas][kTimelineSlots];
#endif
__device__ __forceinline__ void timeline_mark([[maybe_unused]] int slot) {
#ifdef MMQ_STAGED_PROBE_TIMELINE
  if (threadIdx.x == 0 && blockIdx.x < kTimelineCtas && slot < kTimelineSlots) g_timeline[blockIdx.x][slot] = clock64();
#endif
}

constexpr int kTokensIssuedBarrier = 1;  // named barrier: the multiplying warps' first token loads are issued (kHeld)

// How the multiplying warps of a layout that reads its tokens from global memory (not staged) take them: through
// pointers as they multiply, or loaded into registers (UnitTokens) before waiting for the chunk's weights.
enum class TokenLoad { kPointers, kPrefetched };

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

// kHeld (Layout::held_stages, layouts that read their tokens from global memory): the copying warp issues only that
// many stages before the wait for the kernel before, and the rest of the first ring once the multiplying warps have
// passed their own wait (and, where they prefetch tokens, issued their first loads); 0: the whole first ring first.
template <class Q, int W, int MT, int kChunk, int kRing, bool kStagedTokens, int kHeld, bool kSplitLow, bool kRope,
          TokenLoad kLoad>
__global__ void __launch_bounds__(Staging<Q, W, MT, kChunk, kRing, kStagedTokens>::kThreads)
    gguf_mmq_staged_kernel(void* __restrict__ y, bool bf16, const int8_t* xq, const XBlock* xb,
                           const uint8_t* __restrict__ w, int M, int N, int K, int64_t row_bytes,
                           const GgufRopeCache rope) {
#ifdef CANDLE_VLLM_MBARRIER
  using S = Staging<Q, W, MT, kChunk, kRing, kStagedTokens>;
  constexpr bool kPrefetch = kLoad == TokenLoad::kPrefetched;
  static_assert(!kPrefetch || !kStagedTokens, "only tokens read from global memory are prefetched");
  static_assert(kHeld == 0 || !kStagedTokens, "only a ring whose tokens the multiplying warps load is held back");
  constexpr bool kHeldBack = kHeld > 0;
  constexpr int kRows = S::kRows;
  extern __shared__ __align__(16) uint8_t ring[];
  __shared__ alignas(8) uint64_t full[S::kStages], empty[S::kStages];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = blockIdx.x * kRows, units = K / Q::kBlockElems;
  const int chunks = (units + S::kChunkUnits - 1) / S::kChunkUnits;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      mbar_init(smem_addr(&full[s]), kStagedTokens ? 2 : 1);  // the weights', then the tokens' (after the wait)
      mbar_init(smem_addr(&empty[s]), W);
    }
    mbar_fence_init();
  }
  __syncthreads();
  timeline_mark(0);

  float acc[MT][1][4] = {};
  auto units_in = [&](int c) { return min(S::kChunkUnits, units - c * S::kChunkUnits); };
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
    const int early = kHeldBack ? min(kHeld, first) : first;
    for (int c = 0; c < early; ++c) weights(c);
    if constexpr (kStagedTokens) {
      pdl_wait();  // the codes are the kernel before's output, and y may still be read by it
      for (int c = 0; c < first; ++c) tokens(c);
    }
    if constexpr (kHeldBack) {
      pdl_wait();
      named_barrier_sync(kTokensIssuedBarrier, S::kThreads);
      for (int c = early; c < first; ++c) weights(c);
    }
    for (int c = first; c < chunks; ++c) {
      mbar_wait(smem_addr(&empty[c % S::kStages]), (c / S::kStages - 1) & 1);
      weights(c);
      if constexpr (kStagedTokens) tokens(c);
    }
    // With no tokens to copy: wait before the store below writes y, which the kernel before may read (a held-back
    // ring has waited already; the second wait returns at once).
    if constexpr (!kStagedTokens) pdl_wait();
  } else {
    const int g = lane >> 2, t = lane & 3;
    TokenRows xg[1] = {};
    if constexpr (!kStagedTokens) token_rows<Q>(xg, xq, xb, M, K, warp * Q::kBlockElems, g, t);
    pdl_wait();  // xq/xb are the kernel before's; y may still be read by it
    timeline_mark(34);
    if constexpr (kHeldBack && !kPrefetch) named_barrier_arrive(kTokensIssuedBarrier, S::kThreads);
    // kPrefetch: ahead[i] holds the tokens of the warp's unit i of the chunk being multiplied (UnitTokens), loaded
    // before the wait for its weights. next_x points at the next chunk to load.
    UnitTokens<Q> ahead[kPrefetch ? S::kUnitsPerWarp : 1];
    if constexpr (kProbe == 2)
      for (UnitTokens<Q>& a : ahead) a = {};
    TokenRows next_x = xg[0];
    auto prefetch = [&](int c, int i) {
      if (kProbe != 2 && warp + W * i < units_in(c)) ahead[i].load(next_x.shifted(W * i * Q::kBlockElems));
    };
    auto prefetch_chunk = [&](int c) {
#pragma unroll
      for (int i = 0; i < S::kUnitsPerWarp; ++i) prefetch(c, i);
      next_x.advance(S::kTokenElems);
    };
    for (int c = 0; c < chunks; ++c) {
      if constexpr (kPrefetch) prefetch_chunk(c);
      if constexpr (kHeldBack && kPrefetch)
        if (c == 0) named_barrier_arrive(kTokensIssuedBarrier, S::kThreads);
      const int s = c % S::kStages;
      mbar_wait(smem_addr(&full[s]), (c / S::kStages) & 1);
      if (c < 32) timeline_mark(1 + c);
      const int in_chunk = kProbe == 1 ? 0 : units_in(c);
      const uint8_t* stage = stage_at(c);
      const int lane_off = (Q::kSplitLanes ? 4 : 8) * t;
      const uint8_t* codes = stage + S::kWeightBytes + min(g, M - 1) * S::kTokenStride + lane_off;
      const uint8_t* blocks = stage + S::kWeightBytes + 8 * S::kTokenStride;
      const int block_stride = S::kBlockStride;
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
          if constexpr (kStagedTokens) {
            TokenRowsOf<true> x[1];
            x[0].codes = reinterpret_cast<const int8_t*>(codes) + u * Q::kBlockElems;
#pragma unroll
            for (int k = 0; k < 2; ++k)
              x[0].blocks[k] = reinterpret_cast<const XBlock*>(blocks + min(2 * t + k, M - 1) * block_stride) +
                               u * Q::kBlockElems / 32;
            multiply_any<Q, MT, 1, kSplitLow>(q, t, x, acc);
          } else if constexpr (kPrefetch) {
            const UnitTokens<Q> x[1] = {ahead[i]};
            multiply_any<Q, MT, 1, kSplitLow>(q, t, x, acc);
          } else {
            multiply_any<Q, MT, 1, kSplitLow>(q, t, xg, acc);
            xg[0].advance(W * Q::kBlockElems);
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty[s]));
    }
  }
  timeline_mark(33);
  if constexpr (kProbe == 4) {  // every thread leaves here, before store_rows' barrier
    if (acc[0][0][0] == 1.25e-30f) static_cast<float*>(y)[threadIdx.x] = acc[MT - 1][0][3];
    return;
  }
  pdl_launch_dependents();
  scale_output<Q>(acc);
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
           auto probe =
               gguf_mmq_staged_kernel<mmq::MmqQ4K, 4, 1, 512, 16384, false, 0, false, false, TokenLoad::kPointers>;
           check_cuda(cudaFuncGetAttributes(&attr, probe), "gguf_mmq_staged");
           return major == 9 && attr.binaryVersion == 90 ? 1 : 2;
         }) == 1;
}

template <class Q, int W, int MT, int kChunk, int kRing, bool kStagedTokens, int kHeld, bool kSplitLow, bool kRope,
          TokenLoad kLoad>
void launch(void* y, bool bf16, const int8_t* xq, const XBlock* xb, const uint8_t* w, int M, int N, int K,
            const GgufRopeCache& rope, cudaStream_t s) {
  using S = Staging<Q, W, MT, kChunk, kRing, kStagedTokens>;
  auto kernel = gguf_mmq_staged_kernel<Q, W, MT, kChunk, kRing, kStagedTokens, kHeld, kSplitLow, kRope, kLoad>;
  static_assert(S::kSmemBytes <= 227 * 1024, "more shared memory than a Hopper CTA can have");
  static std::atomic<int> sized[kMaxDevices];  // more than 48 KB of dynamic shared memory, once per device
  per_device(sized, "gguf_mmq_staged", [&](int) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes),
               "gguf_mmq_staged: shared-memory limit");
    return 1;
  });
  const int64_t row_bytes = mmq::loader_row_bytes<Q>(K);
  launch_pdl(kRope ? "gguf_mmq_staged_rope_cache" : "gguf_mmq_staged", kernel, dim3((N + S::kRows - 1) / S::kRows),
             dim3(S::kThreads), S::kSmemBytes, s, y, bf16, xq, xb, w, M, N, K, row_bytes, rope);
}

// Whether the global-token layouts that prefetch (prefetches_tokens) do: CANDLE_VLLM_STAGED_PREFETCH=0 keeps the
// pointer form, for an A/B in one build.
bool prefetch_tokens() {
  static const bool prefetch = env_switch_on("CANDLE_VLLM_STAGED_PREFETCH");
  return prefetch;
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
      auto with = [&](auto rope_tag, auto load_tag) {
        launch<Q, kW, L.m_tiles, L.chunk, L.ring, L.staged_tokens, L.held_stages, L.split_low,
               decltype(rope_tag)::value, decltype(load_tag)::value>(y, bf16, xq, xb, w, M, N, K, r, stream);
      };
      auto loaded = [&](auto rope_tag) {
        constexpr bool kPrefetch = !L.staged_tokens && prefetches_tokens<Q>(kShape);
        using Prefetched =
            std::integral_constant<TokenLoad, kPrefetch ? TokenLoad::kPrefetched : TokenLoad::kPointers>;
        if (kPrefetch && prefetch_tokens()) with(rope_tag, Prefetched{});
        else with(rope_tag, std::integral_constant<TokenLoad, TokenLoad::kPointers>{});
      };
      if (rope != nullptr) loaded(std::true_type{});
      else loaded(std::false_type{});
    };
    auto shaped = [&](auto w_tag) {
      using Wide = std::integral_constant<Shape, Shape::kWide>;
      using Long = std::integral_constant<Shape, Shape::kNarrowLong>;
      using Narrow = std::integral_constant<Shape, Shape::kNarrow>;
      if (N >= kStagedWideRows) go(w_tag, Wide{});
      else if (K >= kLongRowsK) go(w_tag, Long{});
      else go(w_tag, Narrow{});
    };
    if (warps == 16) shaped(std::integral_constant<int, 16>{});
    else if (warps == 8) shaped(std::integral_constant<int, 8>{});
    else shaped(std::integral_constant<int, 4>{});
  });
}

}  // namespace candle_vllm::cuda
