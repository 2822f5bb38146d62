"""The interleaved-halves weight layout (the skinny GEMM's fused RoPE and SwiGLU formats), on CPU: which rows
share a 16-row tile, the output's way back to the standard layout, and a dense method holding a q/k/v weight in
that layout. Integer-valued data keeps every matmul exact, so results compare bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from candle_vllm.pyengine.ops.rotary import RopeCacheTarget, apply_rotary, rope_cos_sin_cache, rope_inv_freq
from candle_vllm.pyengine.ops.row_pairs import deinterleave_halves, interleave_halves
from candle_vllm.pyengine.quant.base import build_linear_methods
from candle_vllm.pyengine.quant.unquantized import UnquantizedLinear


def _ints(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).float()


@pytest.mark.parametrize("block,blocks", [(16, 1), (64, 3), (128, 5)])
def test_each_tile_holds_eight_pairs_of_one_block(block: int, blocks: int) -> None:
    w = _ints(block * blocks, 7, seed=block)
    wi = interleave_halves(w, block)
    half = block // 2
    for b in range(blocks):
        for j in range(block // 16):
            tile = wi[b * block + 16 * j : b * block + 16 * (j + 1)]
            assert torch.equal(tile[:8], w[b * block + 8 * j : b * block + 8 * j + 8])
            assert torch.equal(tile[8:], w[b * block + half + 8 * j : b * block + half + 8 * j + 8])
    x = _ints(3, 7, seed=1)
    assert torch.equal(deinterleave_halves(F.linear(x, wi), block), F.linear(x, w))


def test_interleaving_needs_whole_tiles_per_block() -> None:
    with pytest.raises(ValueError, match="blocks of 16k rows"):
        interleave_halves(torch.zeros(48, 4), 24)
    with pytest.raises(ValueError, match="blocks of 16k rows"):
        interleave_halves(torch.zeros(40, 4), 32)


def test_dense_qkv_method_returns_the_paired_layout() -> None:
    hq, hk, d, k = 3, 1, 32, 24
    w = _ints((hq + 2 * hk) * d, k, seed=3)
    rot = (hq + hk) * d
    fused, plain = UnquantizedLinear(w.clone(), rope_rows=rot, head_dim=d), UnquantizedLinear(w.clone())
    assert fused.rope_pair_group == 8 and not plain.rope_pair_group
    assert torch.equal(fused.weight[rot:], w[rot:]) and not torch.equal(fused.weight[:rot], w[:rot])
    x = _ints(5, k, seed=4)
    got, want = fused(x), plain(x)
    assert torch.equal(got[:, rot:], want[:, rot:])  # v as it is
    assert torch.equal(deinterleave_halves(got[:, :rot].reshape(5, hq + hk, d), d).reshape(5, rot), want[:, :rot])
    pos, slots = torch.arange(5), torch.arange(5)
    cache = torch.zeros(2, 1, 16, hk, d)
    target = RopeCacheTarget(hk, pos, torch.ones(10, d), cache, slots)
    assert fused.forward_rope_cache(x, target) is None  # no kernel on CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [8, 1])
def test_rotating_paired_heads_equals_rotating_standard_ones(dtype: torch.dtype, group: int) -> None:
    """The torch path of apply_rotary(pair_group=...) against the standard layout rotated as usual."""
    t, hq, hk, d = 6, 4, 2, 64
    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(t, hq, d, generator=g).to(dtype), torch.randn(t, hk, d, generator=g).to(dtype)
    inv_freq, factor = rope_inv_freq(d, 10000.0)
    table = rope_cos_sin_cache(inv_freq, factor, 100, torch.device("cpu"))
    pos = torch.randint(0, 100, (t,), generator=g)
    want_q, want_k = apply_rotary(q.clone(), k.clone(), pos, table, True)
    as_stored = [interleave_halves(x.reshape(-1, d).T.contiguous(), d, group).T.reshape(x.shape) for x in (q, k)]
    got_q, got_k = apply_rotary(as_stored[0], as_stored[1], pos, table, True, pair_group=group)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_only_a_whole_half_precision_cuda_qkv_is_interleaved() -> None:
    q, k_, v = _ints(64, 16, seed=5), _ints(32, 16, seed=6), _ints(32, 16, seed=7)
    (cpu,) = build_linear_methods([q, k_, v], torch.bfloat16, torch.device("cpu"), rope_head_dim=32)
    assert isinstance(cpu, UnquantizedLinear) and cpu.rope_rows == 0
