"""The GGUF q/k/v layout for the dp4a GEMV's RoPE epilogue, on CPU: the row permutation (pair group 1 of
``ops.row_pairs``) applied to GGUF block rows, its way back, the rotation of a projection in that layout, and
where the layout is chosen. Oracles: the ``gguf`` package's quantizer and dequantizer, the CPU quantized matmul on
the unpermuted blocks (rows are independent, so permuted rows give the same bits), and the standard RoPE."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from candle_vllm.pyengine.ops.quant import quant_matmul
from candle_vllm.pyengine.ops.rotary import apply_rotary, rope_cos_sin_cache, rope_inv_freq
from candle_vllm.pyengine.ops.row_pairs import deinterleave_halves, interleave_halves
from candle_vllm.pyengine.quant import gguf as gguf_quant
from candle_vllm.pyengine.quant.base import build_linear_methods
from candle_vllm.pyengine.quant.gguf import GGUFLinear, GGUFWeight

HQ, HK, D, K = 3, 1, 64, 96


def _ints(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("block,blocks", [(2, 1), (64, 3), (128, 2)])
def test_group_one_puts_each_pair_on_adjacent_rows(block: int, blocks: int) -> None:
    w = _ints(block * blocks, 5, seed=block)
    wi = interleave_halves(w, block, 1)
    half = block // 2
    for b in range(blocks):
        for j in range(half):
            assert torch.equal(wi[b * block + 2 * j], w[b * block + j])
            assert torch.equal(wi[b * block + 2 * j + 1], w[b * block + half + j])
    x = _ints(4, 5, seed=2)
    assert torch.equal(deinterleave_halves(F.linear(x, wi), block, 1), F.linear(x, w))
    with pytest.raises(ValueError, match="blocks of 2k rows"):
        interleave_halves(w[:3], 3, 1)


def _qkv_blocks(qtype: QT, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    n = (HQ + 2 * HK) * D
    w = torch.randn(n, K, generator=torch.Generator().manual_seed(seed)).numpy()
    return w, torch.from_numpy(gguf_quantize(w, qtype))


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0], ids=lambda t: t.name)
def test_permuted_gguf_rows_round_trip_and_multiply_alike(qtype: QT) -> None:
    """GGUFLinear with rope rows gathers whole block rows: the gguf package decodes the permuted bytes to the
    permuted rows, the output comes back to the standard layout exactly, and rotating it with pair_group=1 gives
    the standard rotation of the unpermuted weight's output."""
    _, blocks = _qkv_blocks(qtype, seed=int(qtype))
    n, rot = blocks.shape[0], (HQ + HK) * D
    weight = GGUFWeight(blocks, qtype, (n, K))
    paired = GGUFLinear(weight, torch.device("cpu"), rope_rows=rot, head_dim=D)
    plain = GGUFLinear(weight, torch.device("cpu"))
    assert paired.rope_pair_group == 1 and plain.rope_pair_group == 0
    assert torch.equal(paired.data[rot:], blocks[rot:]) and not torch.equal(paired.data[:rot], blocks[:rot])
    decoded = torch.from_numpy(gguf_dequantize(paired.data.numpy(), qtype))
    want = torch.from_numpy(gguf_dequantize(blocks.numpy(), qtype))
    back = deinterleave_halves(decoded[:rot].T.reshape(K, HQ + HK, D), D, 1).reshape(K, rot).T
    assert torch.equal(back, want[:rot]) and torch.equal(decoded[rot:], want[rot:])

    t = 5
    x = torch.randn(t, K, generator=torch.Generator().manual_seed(1))
    y, y_std = paired(x), quant_matmul(x, blocks, qtype, n, K)
    assert torch.equal(y[:, rot:], y_std[:, rot:])
    heads = deinterleave_halves(y[:, :rot].reshape(t, HQ + HK, D), D, 1).reshape(t, rot)
    assert torch.equal(heads, y_std[:, :rot])
    inv_freq, factor = rope_inv_freq(D, 10000.0)
    table = rope_cos_sin_cache(inv_freq, factor, 64, torch.device("cpu"))
    pos = torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(2))

    def rotated(out: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = out[:, : HQ * D].reshape(t, HQ, D), out[:, HQ * D : rot].reshape(t, HK, D)
        return apply_rotary(q, k, pos, table, True, pair_group=group)

    for got, want_rot in zip(rotated(y, paired.rope_pair_group), rotated(y_std, 0), strict=True):
        assert torch.equal(got, want_rot)
    with pytest.raises(ValueError, match="neox"):
        apply_rotary(y[:, : HQ * D].reshape(t, HQ, D), y[:, HQ * D : rot].reshape(t, HK, D), pos, table, False, 1)


def test_layout_is_chosen_only_where_the_epilogue_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU (no dp4a GEMV) keeps the file's row order, and so does CANDLE_VLLM_GGUF_ROPE=0 (read once)."""
    _, blocks = _qkv_blocks(QT.Q8_0, seed=3)
    shards = [GGUFWeight(b, QT.Q8_0, (b.shape[0], K)) for b in blocks.split([HQ * D, HK * D, HK * D])]
    (cpu,) = build_linear_methods(shards, torch.bfloat16, torch.device("cpu"), rope_head_dim=D)
    assert isinstance(cpu, GGUFLinear) and cpu.rope_pair_group == 0 and torch.equal(cpu.data, blocks)
    assert not gguf_quant.rope_epilogue_possible(QT.Q8_0, torch.device("cpu"), torch.bfloat16)
    try:
        for value, want in (("0", False), ("1", True)):
            monkeypatch.setenv("CANDLE_VLLM_GGUF_ROPE", value)
            gguf_quant.rope_epilogue_enabled.cache_clear()
            assert gguf_quant.rope_epilogue_enabled() is want
    finally:
        monkeypatch.delenv("CANDLE_VLLM_GGUF_ROPE", raising=False)
        gguf_quant.rope_epilogue_enabled.cache_clear()
