"""What the L2 policy of the read-once streams (native/cuda/l2_policy.cuh) does to a batch-64 decode layer.

One captured CUDA graph runs the 8B Llama layer's decode chain at batch 64 over several layers' own weights and
KV caches (so nothing stays in L2 from one layer's use to the next): qkv (cuBLASLt) -> paged decode attention ->
o_proj added into the residual (cuBLASLt ``addmm_``) -> gate/up (cuBLASLt) -> the interleaved SiLU with the deferred
norm -> down_proj added into the residual. The RoPE + cache kernel is left out (the same in every setting). Each
setting is a ``CANDLE_VLLM_L2_EVICT_FIRST`` bitmask (read at each launch, so at capture); prints us per layer, the
median of replays, for each setting in turn, ``--rounds`` times.

    python3 benches/probe_l2_policy.py --settings 0 1
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

from candle_vllm.pyengine.ops import cuda, cuda_paged
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm

DEV = torch.device("cuda")
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4096, 14336, 32, 8, 128, 16
GRAPH_CONTEXT = 8192  # the decode graphs' grid is sized for this context (cuda_graphs.MAX_CAPTURED_CONTEXT)


class Layer:
    """One layer's weights and KV cache, random (bf16), its sequences' blocks scattered over the cache."""

    def __init__(self, batch: int, context: int) -> None:
        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=DEV, dtype=torch.bfloat16) * 0.02

        self.qkv = w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        self.o = w(HIDDEN, HEADS * HEAD_DIM)
        self.gate_up = w(2 * INTER, HIDDEN)
        self.down = w(HIDDEN, INTER)
        blocks = batch * (context // BLOCK + 1)
        self.cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        self.tables = torch.randperm(blocks, device=DEV, dtype=torch.int32).view(batch, -1).contiguous()

    def run(self, residual: torch.Tensor, lens: torch.Tensor) -> None:
        qkv = F.linear(residual, self.qkv)
        q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        attn = cuda_paged.paged_decode_attention(q, self.cache, self.tables, lens, HEAD_DIM**-0.5, GRAPH_CONTEXT)
        residual.addmm_(attn.view(residual.shape[0], -1), self.o.t())
        act = cuda.silu_and_mul_interleaved(F.linear(residual, self.gate_up), DeferredRMSNorm(residual, 1e-5))
        assert act is not None
        residual.addmm_(act, self.down.t())


def per_layer_us(layers: list[Layer], residual: torch.Tensor, lens: torch.Tensor, passes: int, reps: int) -> float:
    layers[0].run(residual, lens)  # the attention's first call on a device is not capturable
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(passes):
            for layer in layers:
                layer.run(residual, lens)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (passes * len(layers)))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["0", "1"], help="CANDLE_VLLM_L2_EVICT_FIRST bitmasks")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [Layer(args.batch, args.context) for _ in range(args.layers)]
    residual = torch.empty(args.batch, HIDDEN, device=DEV, dtype=torch.bfloat16)
    lens = torch.full((args.batch,), args.context, device=DEV, dtype=torch.int32)
    print(f"batch {args.batch}, context {args.context}, {args.layers} layers x {args.passes} passes; us per layer")
    for r in range(args.rounds):
        for bits in args.settings:
            os.environ["CANDLE_VLLM_L2_EVICT_FIRST"] = bits
            residual.normal_()  # the chain's residual grows from one replay to the next
            us = per_layer_us(layers, residual, lens, args.passes, args.reps)
            print(f"round {r} evict-first streams {bits}: {us:.2f}", flush=True)


if __name__ == "__main__":
    main()
