"""CpuDecoderStack's argument checks: inconsistent weights and out-of-range step metadata are refused with an
error naming the problem before any native work (the numerics are tested in tests/pyengine/models/
test_llama_cpu_decoder.py against the op-by-op path)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.ops.cpu_decoder import CpuDecoderStack
from candle_vllm.pyengine.ops.rotary import rope_cos_sin_cache, rope_inv_freq

pytestmark = pytest.mark.skipif(native.module() is None, reason="needs the native module")
H, HEADS, KV, D, INTER = 64, 4, 2, 16, 96


def _f32(rows: int, cols: int) -> tuple[torch.Tensor, int, int]:
    """F32 GGUF blocks of a random [rows, cols] matrix."""
    return torch.randn(rows, cols).view(torch.uint8).reshape(rows, -1), int(QT.F32), rows


def _layer_kwargs(**over: object) -> dict[str, object]:
    inv, factor = rope_inv_freq(D, 10000.0)
    kw: dict[str, object] = dict(
        num_heads=HEADS, num_kv_heads=KV, head_dim=D, eps=1e-5, scale=D**-0.5, sliding_window=None,
        input_norm=torch.rand(H) + 0.5, post_norm=torch.rand(H) + 0.5, q_norm=None, k_norm=None,
        qkv=[_f32((HEADS + 2 * KV) * D, H)], qkv_bias=None, o=[_f32(H, HEADS * D)], gate_up=[_f32(2 * INTER, H)],
        down=[_f32(H, INTER)], cos_sin_cache=rope_cos_sin_cache(inv, factor, 32), is_neox=True,
    )
    return kw | over


def test_inconsistent_weights_are_refused() -> None:
    stack = CpuDecoderStack()
    with pytest.raises(ValueError, match="qkv: shape"):
        stack.add_layer(**_layer_kwargs(qkv=[_f32(HEADS * D, H)]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"down: expected .* \[64, 96\] F32"):
        stack.add_layer(**_layer_kwargs(down=[_f32(H, INTER + 32)]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        stack.add_layer(**_layer_kwargs(q_norm=torch.ones(D)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="f32"):
        stack.add_layer(**_layer_kwargs(input_norm=torch.ones(H, dtype=torch.float16)))  # type: ignore[arg-type]
    assert len(stack) == 0
    stack.add_layer(**_layer_kwargs())  # type: ignore[arg-type]
    assert len(stack) == 1


def test_positions_outside_the_rotary_table_are_refused() -> None:
    stack = CpuDecoderStack()
    stack.add_layer(**_layer_kwargs())  # type: ignore[arg-type]
    caches = [torch.randn(2, 4, 8, KV, D)]
    meta = AttentionMetadata.build([1], [33], "cpu", [[0, 1, 2, 3, 0]], 8)
    x, pos = torch.randn(1, H), torch.tensor([32])  # the table covers positions 0..31
    assert stack.step_supported(x, pos, caches, meta)
    with pytest.raises(ValueError, match="outside the rotary table"):
        stack.run(x, pos, caches, meta)
    assert not stack.step_supported(x.half(), pos, caches, meta)
    assert not stack.step_supported(x, pos, [torch.randn(2, 4, 8, KV, 2 * D)], meta)  # a cache of other heads
