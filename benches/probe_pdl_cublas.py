"""Can a captured graph's edges into cuBLASLt's GEMM kernels be programmatic (PDL), so that a GEMM launches while
the kernel before it drains? Only if those kernels wait (griddepcontrol.wait) before reading their inputs, or if the
kernel before them triggers only after its last write. This probe measures both (benches/RESULTS.md, session 20).

Correctness: a graph [writer -> torch.mm (bf16) reading the writer's output] whose writer -> mm edge is made
programmatic after capture (every default kernel -> kernel edge of the graph, here that one):
  early trigger: the writer triggers at entry and writes ~50 us later; a wrong product means the GEMM read its input
                 without waiting;
  late trigger:  the writer writes, fences, syncs its CTA, then triggers.
Timing: a chain of 64 x [our scale kernel (early or late trigger) -> mm 64x4096x4096 bf16], default against
programmatic edges into the GEMMs.

usage (GPU machine; builds an inline extension with nvcc, about a minute): python3 benches/probe_pdl_cublas.py
"""
import math
import sys
import time
from collections.abc import Callable

import torch
from torch.utils.cpp_extension import load_inline

CUDA_SRC = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <vector>

template <bool kLate>
__global__ void slow_writer(__nv_bfloat16* a, int n, long long cycles) {
  if (!kLate) asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) a[i] = __float2bfloat16(1.f);
  if (kLate) { __threadfence(); __syncthreads(); asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
}

template <bool kLate>
__global__ void scale_kernel(__nv_bfloat16* x, int n) {
  if (!kLate) asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    x[i] = __float2bfloat16(__bfloat162float(x[i]) * 0.5f);
  if (kLate) { __threadfence(); __syncthreads(); asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
}

static void launch_pdl(const void* fn, dim3 grid, dim3 block, void** args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid; cfg.blockDim = block;
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr; cfg.numAttrs = 1;
  TORCH_CHECK(cudaLaunchKernelExC(&cfg, fn, args) == cudaSuccess);
}

void write_slow(torch::Tensor a, int64_t cycles, bool late) {
  auto* p = reinterpret_cast<__nv_bfloat16*>(a.data_ptr()); int n = a.numel(); long long c = cycles;
  void* args[] = {&p, &n, &c};
  launch_pdl(late ? (const void*)slow_writer<true> : (const void*)slow_writer<false>, dim3(64), dim3(256), args);
}

void scale(torch::Tensor x, bool late) {
  auto* p = reinterpret_cast<__nv_bfloat16*>(x.data_ptr()); int n = x.numel();
  void* args[] = {&p, &n};
  launch_pdl(late ? (const void*)scale_kernel<true> : (const void*)scale_kernel<false>, dim3(132), dim3(256), args);
}

// Every default kernel -> kernel edge of the (not yet instantiated) graph becomes programmatic; returns how many.
int64_t make_programmatic(int64_t graph_ptr) {
  auto g = reinterpret_cast<cudaGraph_t>(graph_ptr);
  size_t n = 0;
  TORCH_CHECK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n) == cudaSuccess);
  std::vector<cudaGraphNode_t> from(n), to(n);
  std::vector<cudaGraphEdgeData> data(n);
  TORCH_CHECK(cudaGraphGetEdges(g, from.data(), to.data(), data.data(), &n) == cudaSuccess);
  int64_t changed = 0;
  for (size_t i = 0; i < n; ++i) {
    cudaGraphNodeType tf, tt;
    TORCH_CHECK(cudaGraphNodeGetType(from[i], &tf) == cudaSuccess && cudaGraphNodeGetType(to[i], &tt) == cudaSuccess);
    if (tf != cudaGraphNodeTypeKernel || tt != cudaGraphNodeTypeKernel || data[i].type != cudaGraphDependencyTypeDefault)
      continue;
    TORCH_CHECK(cudaGraphRemoveDependencies(g, &from[i], &to[i], &data[i], 1) == cudaSuccess);
    cudaGraphEdgeData d{};
    d.type = cudaGraphDependencyTypeProgrammatic;
    d.from_port = cudaGraphKernelNodePortProgrammatic;
    TORCH_CHECK(cudaGraphAddDependencies(g, &from[i], &to[i], &d, 1) == cudaSuccess);
    ++changed;
  }
  return changed;
}
"""
CPP_SRC = ("void write_slow(torch::Tensor a, int64_t cycles, bool late); void scale(torch::Tensor x, bool late); "
           "int64_t make_programmatic(int64_t graph_ptr);")

ext = load_inline("pdl_probe2", CPP_SRC, cuda_sources=CUDA_SRC, functions=["write_slow", "scale", "make_programmatic"],
                  extra_cuda_cflags=["-gencode=arch=compute_90a,code=sm_90a"], with_cuda=True, verbose=False)
if sys.argv[1:] == ["build"]:  # compile only (overlaps a build of the project)
    sys.exit(0)


def capture(fn: Callable[[], object], programmatic: bool) -> torch.cuda.CUDAGraph:
    fn()  # warm-up: cuBLAS handles and workspace
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        fn()
    if programmatic:
        print("  edges made programmatic:", ext.make_programmatic(g.raw_cuda_graph()))
    g.instantiate()
    return g


def stale_products(m: int, late: bool, programmatic: bool, trials: int = 10) -> int:
    """Replays of [writer -> mm] out of `trials` whose product used the input from before the writer."""
    a = torch.zeros(m, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
    want = (torch.ones_like(a) @ b).float()
    g = capture(lambda: (ext.write_slow(a, 100_000, late), torch.mm(a, b, out=out)), programmatic)
    bad = 0
    for _ in range(trials):
        a.zero_()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        bad += int(((out.float() - want).norm() / want.norm()).item() > 1e-2)
    return bad


def chain_us(late: bool, programmatic: bool) -> float:
    """Best of 5 timings, us per [scale -> mm 64x4096x4096] in a replayed chain of 64."""
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ys = [torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(64)]

    def chain() -> None:
        for y in ys:
            ext.scale(x, late)
            torch.mm(x, w.t(), out=y)

    g = capture(chain, programmatic)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / 20 / len(ys) * 1e6)
    return best


torch.manual_seed(0)
for rows in (64, 1, 16):
    for late_trigger in (False, True):
        for prog in (False, True):
            bad = stale_products(rows, late_trigger, prog)
            print(f"M={rows} late_trigger={late_trigger} programmatic={prog}: {bad}/10 stale products", flush=True)
for late_trigger in (False, True):
    for prog in (False, True):
        print(f"late_trigger={late_trigger} programmatic={prog}: {chain_us(late_trigger, prog):.2f} us per (scale + mm)",
              flush=True)
