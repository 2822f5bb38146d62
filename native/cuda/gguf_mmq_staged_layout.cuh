// The staged GGUF product's layout per type and weight shape (m-tiles, chunk, ring, where the tokens come from), each
// choice with the measurements behind it. Included only by gguf_mmq_staged.cu, whose kernel takes these as template
// arguments: a layout changes only the speed, never the bits.
#pragma once
#include <type_traits>

#include "cuda/gguf_mmq_multiply.cuh"

namespace candle_vllm::cuda {
namespace {

// The staging per type and weight shape, measured on the H200 (session 21, calls 2 and 3; benches/RESULTS.md: us over
// 2, 4 and 8 tokens on the narrow 8B shapes (6144x4096, 4096x4096, 4096x14336) / the wide one (28672x4096), for
// m-tiles x chunk x ring of 1 x 1024 x 64K, 1 x 512 x 32K, 1 x 512 x 16K, 2 x 1024 x 64K, 2 x 512 x 32K):
//   q4k narrow 88 / 86 / 85 / 89 / 88, wide 97 / 86 / 85 / 99 / 78; q2k narrow 106 / 100 / 99 / 98 / 97, wide 112 /
//   87 / 86 / 110 / 76; q6k narrow 147 / 146 / 145 / 157 / 157, wide 138 / 137 / 135 / 155 / 156; q8_0 narrow 138 /
//   149 / 172 / 145 / 171, wide 156 / 145 / 140 / 148 / 133; q4_0 narrow 126 / 132 / 135 / 133 / 139, wide 138 / 110 /
//   121 / 125 / 112.
// So wide weights take two m-tiles (32 rows a CTA: a token load serves twice the rows), 512-byte chunks and a 32 KB
// ring, except the types whose half-block units hold the most per row (Q6_K, Q3_K: one m-tile and a 16 KB ring; Q3_K
// two since session 54, below);
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
// The tokens resident in shared memory for the whole of K (session 24) served q8_0's short narrow rows until session
// 54 measured them against prefetched tokens (H100, bench_quant_cuda.py --kernels mmq, two rounds, a switch read at
// launch): prefetched was 17-18 % faster at 2 tokens, 7-11 % at 4 and 7-27 % at 8 on 4096x4096 / 6144x4096, and
// q8_0 batch-8 decode +3.4 / +4.1 %. The staged tokens kept their place: read from global memory and prefetched
// instead, q4_0's and q4_1's long rows were 6-30 % slower at 8 tokens and q6k's at 2 (q4_0 batch-8 decode -7.2 /
// -7.5 %, q4_1 -4.8 / -4.7 %, q6k -3.8 / -3.7 %); q5_1's long rows 9-12 % faster, but its narrow weights never take
// the product (ops/quant.py MMQ_MIN_ROWS). The min terms in two chains in every K-quant layout with mins, the same
// way: slower on most shapes (q5k wide 4-7 %, q2k wide 10 % at 8 tokens, q2k 4096x4096 4-5 % at 2-4, q4k 4096x4096
// 3 % at 8; batch-8 decode with all of them: q4k even, q5k -3.5 / -4.0 %, q2k -7.3 / -7.4 %), but Q5_K's short narrow
// rows 11-14 % faster on 4096x4096 (8 warps) and even on 6144x4096 (4 warps). Those alone in two chains, against
// main in one call: q5k decode +0.9 / +1.0 % at batch 2, +1.0 / +1.6 % at 4, -0.9 / -0.7 % at 8; not kept.
// Then, with prefetched tokens, two m-tiles where one served (session 54, call 4, the same way; us at 2 / 4 / 8 tokens,
// round 1's change, then round 2's; batch-8 decode two rounds):
//   - q3k wide (28672x4096): +5.7 / +5.7 %, +2.3 / +2.1 %, -7.0 / -5.2 % (it takes the product from 3 tokens);
//     decode +2.2 / +3.2 %: taken.
//   - q8_0 short narrow rows in a 96 KB ring: at 8 tokens (it takes the product from 5) +6.1 / +9.1 % on 4096x4096,
//     -2.7 / -2.2 % on 6144x4096; decode +1.4 / +1.1 %: taken, by the decode.
//   - q4k short narrow rows in a 96 KB ring: 4096x4096 -1.4 / -1.2 %, -3.7 / -3.7 %, -6.7 / -6.3 %; 6144x4096 -15.2 /
//     -13.8 %, -15.5 / -14.5 %, -10.7 / -8.7 %; decode +1.1 / -0.6 % (batch 4, one round: +1.1 %): taken.
//   - q5k the same: within +3.5 / -3.7 %, decode -0.3 / -0.5 %; q6k wide: +9 % at 2-4 tokens, decode -0.5 / -1.1 %.
// Two m-tiles in a 96 KB ring with held tokens (since session 53 prefetched instead: prefetches_tokens) for the short
// narrow rows instead (session 37, call 4, on an H100: us summed over 2, 4 and 8 tokens on 6144x4096 / 4096x4096, two
// rounds within 1 %): q4_0 -16.7 / -16.0 %, q5_1 -10.9 / -20.6 %, q5_0 -0.2 / -16.8 %, q3k +1.7 / -12.7 %; q2k -4.3 /
// +0.6 %, q6k -3.2 / +0.9 %, q5k -8.3 / +10.4 %, q4k -2.0 / +13.4 % (kept as they were); on long rows q8_0 +22 %, q4k
// +7 %, q5k +9 %.
// Long rows (K >= kLongRowsK): the narrow shape whose layouts differ.
struct Layout {
  int m_tiles, chunk, ring;
  bool staged_tokens, split_low;
  int held_stages = 0;  // stages issued before the wait for the kernel before (0: the whole first ring; kernel's kHeld)
};
constexpr int kStagedWideRows = 16384;
constexpr int kLongRowsK = 8192;
enum class Shape { kNarrow, kNarrowLong, kWide };

template <class Q>
constexpr Layout ring_layout(Shape shape) {
  if (shape == Shape::kWide)
    return std::is_same_v<Q, mmq::MmqQ6K> ? Layout{1, 512, 16384, false, false} : Layout{2, 512, 32768, false, false};
  constexpr Layout kDeepRing{2, 512, 98304, false, false};
  if (!Q::kUnitScales) {
    if (std::is_same_v<Q, mmq::MmqQ5_0> || shape != Shape::kNarrowLong) return kDeepRing;
    constexpr bool kStaged =
        std::is_same_v<Q, mmq::MmqQ4_0> || std::is_same_v<Q, mmq::MmqQ4_1> || std::is_same_v<Q, mmq::MmqQ5_1>;
    return Layout{1, 1024, 65536, kStaged, false};
  }
  if (shape == Shape::kNarrow)
    return std::is_same_v<Q, mmq::MmqQ3K> || std::is_same_v<Q, mmq::MmqQ4K> ? kDeepRing
                                                                             : Layout{1, 512, 16384, false, false};
  if (std::is_same_v<Q, mmq::MmqQ2K> || std::is_same_v<Q, mmq::MmqQ3K>) return kDeepRing;
  return Layout{1, 512, 16384, std::is_same_v<Q, mmq::MmqQ6K>,
                std::is_same_v<Q, mmq::MmqQ4K> || std::is_same_v<Q, mmq::MmqQ5K>};
}

// Q2_K's short narrow rows take held_stages = 2 (the kernel's kHeld). Their ring is two stages, each a 2048-element
// chunk of the row, so on 4096-element rows nothing is held back: what changes is that the copying warp, its copies
// issued, waits for the kernel before and for the multiplying warps to pass their own wait (a named barrier) before
// it goes on. Why that saves a quarter of the launch is not understood. Measured (H100, session 60,
// benches/RESULTS.md): in the parts probe, at the rule's 16 warps on 4096x4096, 7.00 -> 5.23 us at 2 tokens and
// 8.36 -> 5.97 at 8; at its 4 warps on 6144x4096 -3.1 / -1.3 %. Every other layout was even or slower with held_stages
// = 2 (most within 2 %, Q6_K's 4096x4096 +5..+8 %, Q2_K's long rows +9 % at 2 tokens).
template <class Q>
constexpr Layout rule_layout(Shape shape) {
  Layout l = ring_layout<Q>(shape);
  if (std::is_same_v<Q, mmq::MmqQ2K> && shape == Shape::kNarrow) l.held_stages = 2;
  return l;
}

// The layout a launch takes: the rule's, or in benches/probe_mmq_parts.cu's builds with every chunk
// MMQ_STAGED_PROBE_CHUNK bytes a row, or every ring whose tokens are loaded by the multiplying warps held back to
// MMQ_STAGED_PROBE_HELD stages.
template <class Q>
constexpr Layout layout(Shape shape) {
  Layout l = rule_layout<Q>(shape);
#ifdef MMQ_STAGED_PROBE_CHUNK
  l.chunk = MMQ_STAGED_PROBE_CHUNK;
#endif
#ifdef MMQ_STAGED_PROBE_HELD
  if (!l.staged_tokens) l.held_stages = MMQ_STAGED_PROBE_HELD;
#endif
  return l;
}

// Whether a layout of loader Q that reads its tokens from global memory (not staged) loads each chunk's into
// registers just before it waits for the chunk's weights (TokenLoad::kPrefetched), so their L2 latency overlaps that
// wait, instead of reading them through pointers as it multiplies. Measured on H100s with
// bench_decode.py at batch 8 (4) and the switch read at launch, both settings in one build, two rounds:
//   - session 52, the layouts that read through pointers then: q4k +1.4 / +2.2 % (batch 4: +2.9 / +3.1 %), q8_0
//     +2.7 / +2.9 %, q5k +1.7 / +2.2 %, q6k +0.3 / +0.3 %; q2k -5.3 / -6.2 %, whose kernels were 3-7 % slower at 8
//     tokens on 6144x4096 and 28672x4096 but 10-11 % faster on its long rows (4096x14336) at 4 and 8;
//   - session 53: Q2_K's long rows alone, q2k +1.0 / +1.3 %; and the layouts that held a chunk's tokens in registers
//     while multiplying the chunk before (session 37's form: the wide shape but for Q2_K, Q3_K and Q8_0, the two-m-tile
//     short narrow rows, Q3_K/Q5_0/Q5_K long rows) prefetched instead: q4k +4.2 / +5.0 %, q6k +3.4 %, q4_0 +2.2 %,
//     q5_1 +1.4 % (q4k two rounds, the others one; q4_1, q5_0, q3k and q5k tested, not timed).
// So every such layout prefetches except Q2_K's short narrow rows and wide weights.
template <class Q>
constexpr bool prefetches_tokens(Shape shape) {
  return !std::is_same_v<Q, mmq::MmqQ2K> || shape == Shape::kNarrowLong;
}

}  // namespace
}  // namespace candle_vllm::cuda
