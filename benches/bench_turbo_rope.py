"""The RoPE + TurboQuant row write kernel alone (``turbo_rope.cu``), on Llama-3-8B heads (32 q / 8 kv, D = 128,
q/k heads in the paired layout of the decode GEMM's RoPE epilogue, views into one fused qkv buffer).

Why: end to end, a turbo step's RoPE + write is one small launch among ~10 a layer; this times it alone against
what it replaced (the RoPE kernel, then the row write) and against the dense cache's RoPE + cache kernel, at a
batch-1 and a batch-64 decode step, with and without the deferred norm (the folded-norm steps of 17-256 tokens).
Each figure is microseconds per call from replays of a CUDA graph of back-to-back calls (``graph_seconds``): the
inputs are a few hundred KB and stay in L2, as the projection just wrote them in a real step.

    python3 benches/bench_turbo_rope.py [--modes turbo4 turbo8] [--tokens 1 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_kernels import graph_seconds

from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import cuda_rotary, cuda_turbo
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm

DEV = torch.device("cuda")
HQ, HK, D, BLOCK, HIDDEN, PAIR_GROUP = 32, 8, 128, 64, 4096, 8
TOKENS = (1, 64)


def time_case(mode: str, tokens: int, with_norm: bool) -> dict:
    """One step size: the fused kernel, the two launches it replaced (no norm: the RoPE kernel alone takes none)
    and the dense RoPE + cache kernel, us per call."""
    g = torch.Generator(device=DEV).manual_seed(tokens)
    fmt = TurboFormat(mode, D)
    qkv = torch.randn(tokens, (HQ + 2 * HK) * D, generator=g, device=DEV).to(torch.bfloat16)
    q, k, v = (x.view(tokens, -1, D) for x in qkv.split([HQ * D, HK * D, HK * D], -1))
    angles = torch.rand(8192, D // 2, generator=g, device=DEV) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).contiguous()
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEV)
    blocks = (tokens + BLOCK - 1) // BLOCK
    slots = torch.randperm(blocks * BLOCK, generator=g, device=DEV)[:tokens]
    rows = torch.zeros(1, blocks, BLOCK, HK, fmt.row_bytes, dtype=torch.uint8, device=DEV)
    dense = torch.zeros(2, blocks, BLOCK, HK, D, dtype=torch.bfloat16, device=DEV)
    # Rows of rms ~1: the replays scale q/k/v in place again and again without overflowing.
    norm = DeferredRMSNorm(torch.randn(tokens, HIDDEN, generator=g, device=DEV).to(torch.bfloat16), 1e-5) \
        if with_norm else None
    row: dict = dict(mode=mode, tokens=tokens, norm=with_norm)
    row["fused_us"] = 1e6 * graph_seconds(lambda i: cuda_turbo.rope_cache_write_(
        q, k, v, positions, cos_sin, True, rows, slots, fmt, PAIR_GROUP, norm))
    if not with_norm:
        def two_launches(i: int) -> None:
            cuda_rotary.rotary_embedding_(q, k, positions, cos_sin, True, PAIR_GROUP)
            cuda_turbo.turbo_cache_write(k, v, rows, slots, fmt)
        row["rope_then_write_us"] = 1e6 * graph_seconds(two_launches)
    row["dense_rope_cache_us"] = 1e6 * graph_seconds(lambda i: cuda_rotary.rotary_embedding_cache_(
        q, k, v, positions, cos_sin, True, dense, slots, PAIR_GROUP, norm))
    print(f"{mode} tokens={tokens} norm={with_norm}: "
          + "  ".join(f"{name} {us:.2f}" for name, us in row.items() if name.endswith("_us")), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", nargs="+", default=["turbo4", "turbo8"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="step sizes (tokens)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    results = [time_case(mode, t, norm) for mode in args.modes for t in args.tokens for norm in (False, True)
               if t > 1 or not norm]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
