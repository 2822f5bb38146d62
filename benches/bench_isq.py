"""In-situ quantization speed and memory: per-type quantize throughput on Llama-3-8B's largest projection, and a
whole dummy Llama-3-8B load with ``--isq`` (wall time, peak and final device memory) next to the bf16 load.

    python benches/bench_isq.py                          # CUDA when present, else CPU (throughput only)
    python benches/bench_isq.py --types q4k q8_0 --load q4k

Throughput counts input values per second (the 8B model's decoder linears hold 6.98e9 values); peak memory is
``torch.cuda.max_memory_allocated`` over the load, so it shows how much one dense tensor in flight costs on top
of the quantized model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from candle_vllm.pyengine.loader import load_model, resolve_model_source
from candle_vllm.pyengine.quant.isq import ISQ_QTYPES, quantize

LINEAR_VALUES_8B = 6.98e9
SHAPE = (14336, 4096)  # gate/up rows of Llama-3-8B


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(name: str, device: torch.device, reps: int) -> float:
    """Input values per second quantizing one bf16 [14336, 4096] matrix (median of ``reps``)."""
    w = torch.randn(SHAPE, device=device).to(torch.bfloat16) * 0.02
    quantize(w, name)  # warm-up (kernel load)
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        quantize(w, name)
        _sync(device)
        times.append(time.perf_counter() - t)
    return w.numel() / sorted(times)[len(times) // 2]


def load(config_dir: Path, device: torch.device, isq: str | None) -> tuple[float, float, float]:
    """(seconds, peak GiB, final GiB) of a dummy bf16 load with ``isq``."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    t = time.perf_counter()
    model = load_model(resolve_model_source(str(config_dir), load_format="dummy"), torch.bfloat16, device,
                       load_format="dummy", isq=isq).model
    _sync(device)
    seconds = time.perf_counter() - t
    final = (torch.cuda.memory_allocated(device) - base) / 2**30
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    del model
    return seconds, peak, final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=list(ISQ_QTYPES), choices=list(ISQ_QTYPES))
    ap.add_argument("--load", nargs="*", default=["q4k", "q8_0"], choices=list(ISQ_QTYPES))
    ap.add_argument("--model", default=str(Path(__file__).parent / "configs" / "llama-3-8b"))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{torch.get_num_threads()} CPU threads")
    for name in args.types:
        rate = throughput(name, device, args.reps if device.type == "cuda" else 1)
        print(f"quantize {name:5s} {SHAPE}: {rate / 1e9:7.3f} Gvalues/s -> 8B decoder linears in "
              f"{LINEAR_VALUES_8B / rate:7.1f} s")
    if device.type == "cuda":
        for isq in [None, *args.load]:
            seconds, peak, final = load(Path(args.model), device, isq)
            print(f"load dummy 8B --isq {isq or 'none':5s}: {seconds:6.1f} s, peak {peak:6.2f} GiB, "
                  f"final {final:6.2f} GiB")


if __name__ == "__main__":
    main()
