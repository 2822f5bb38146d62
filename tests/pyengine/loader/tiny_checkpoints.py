"""Tiny random GGUF files for loader tests, written with the ``gguf`` package."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def write_tiny_gguf(path: Path, arch: str = "llama", split_max_tensors: int = 0,
                    pooling: gguf.PoolingType | None = None) -> Path:
    """A complete tiny random GGUF model of ``arch`` (F32 tensors, untied), naming ``pooling`` if given."""
    rng = np.random.default_rng(0)
    h, i, layers, vocab, heads, kv = 32, 64, 2, 64, 2, 1
    d = h // heads
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(h)
    w.add_feed_forward_length(i)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    if pooling is not None:
        w.add_pooling_type(pooling)
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "output.weight": (vocab, h)}
    for n in range(layers):
        shapes |= {
            f"blk.{n}.attn_norm.weight": (h,), f"blk.{n}.ffn_norm.weight": (h,),
            f"blk.{n}.attn_q.weight": (heads * d, h), f"blk.{n}.attn_k.weight": (kv * d, h),
            f"blk.{n}.attn_v.weight": (kv * d, h), f"blk.{n}.attn_output.weight": (h, heads * d),
            f"blk.{n}.ffn_gate.weight": (i, h), f"blk.{n}.ffn_up.weight": (i, h), f"blk.{n}.ffn_down.weight": (h, i),
        }
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
