// The staged GGUF product (native/cuda/gguf_mmq_staged.cu) built on its own with one part of its work left out
// (MMQ_STAGED_PROBE: 0 none, 1 the multiplying, 2 the token loads, 4 the store and the trigger before it), another
// chunk (MMQ_STAGED_PROBE_CHUNK: bytes a row a stage) or every ring held back (MMQ_STAGED_PROBE_HELD: stages issued
// before the wait for the kernel before, gguf_mmq_staged_layout.cuh), so benches/probe_mmq_parts.py can time each
// build's launches back to back and place the kernel's time by differences. One shared library per build:
//     nvcc -std=c++17 -O3 --expt-relaxed-constexpr --use_fast_math -shared -Xcompiler -fPIC \
//         -gencode=arch=compute_90a,code=sm_90a -I native -DMMQ_STAGED_PROBE=<part> \
//         benches/probe_mmq_parts.cu -o /tmp/probe_mmq_<part>.so
#include "cuda/gguf_mmq_staged.cu"

extern "C" int probe_mmq(void* y, const void* xq, const void* xb, const void* w, int M, int N, int K, int qtype,
                         int warps, cudaStream_t stream) {
  candle_vllm::cuda::launch_gguf_mmq_staged(y, true, static_cast<const int8_t*>(xq),
                                            static_cast<const candle_vllm::gguf::XBlock*>(xb),
                                            static_cast<const uint8_t*>(w), M, N, K, qtype, warps, nullptr, stream);
  return static_cast<int>(cudaGetLastError());
}

// The part this build leaves out (0: none), so the probe compares the outputs of the whole builds.
extern "C" int probe_part() { return candle_vllm::cuda::kProbe; }

#ifdef MMQ_STAGED_PROBE_TIMELINE
// The timeline of the launches since the last read (gguf_mmq_staged.cu g_timeline: SM clocks per CTA at its start,
// chunk arrivals, end; each launch overwrites the last's), then cleared.
extern "C" int probe_timeline(long long* out, int ctas) {
  namespace cv = candle_vllm::cuda;
  const size_t rows = ctas < cv::kTimelineCtas ? ctas : cv::kTimelineCtas;
  cudaError_t err = cudaMemcpyFromSymbol(out, cv::g_timeline, sizeof(long long) * cv::kTimelineSlots * rows);
  void* slots = nullptr;  // cleared, so the next read holds only later launches' marks
  if (err == cudaSuccess) err = cudaGetSymbolAddress(&slots, cv::g_timeline);
  if (err == cudaSuccess) err = cudaMemset(slots, 0, sizeof(cv::g_timeline));
  return static_cast<int>(err);
}
#endif
