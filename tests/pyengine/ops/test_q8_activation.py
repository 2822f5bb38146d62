"""The q8 producer fusion's plumbing off the GPU: ``q8=32/256`` changes nothing on the CPU, linears that do not use
the int8 codes run on the dense tensor, and the CANDLE_VLLM_Q8_FUSION switch. (Codes and GEMVs on the GPU:
tests/native/test_cuda_q8_fusion.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import pytest
import torch

from candle_vllm.pyengine.layers import Linear
from candle_vllm.pyengine.ops import q8_activation
from candle_vllm.pyengine.ops.activation import silu_and_mul
from candle_vllm.pyengine.ops.norm import fused_add_rms_norm, rms_norm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation
from candle_vllm.pyengine.quant.gguf import GGUFLinear
from candle_vllm.pyengine.quant.isq import isq_weight, resolve_qtype

CPU = torch.device("cpu")


@pytest.fixture
def fresh_switch() -> Iterator[None]:
    q8_activation.fusion_enabled.cache_clear()
    yield
    q8_activation.fusion_enabled.cache_clear()


def _x(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("group", [32, 256])
def test_q8_is_a_no_op_on_cpu(group: int) -> None:
    x, res, w = _x(3, 256, 1), _x(3, 256, 2), _x(1, 256, 3)[0]
    assert torch.equal(cast(torch.Tensor, rms_norm(x, w, 1e-5, q8=group)), rms_norm(x, w, 1e-5))
    got, got_res = fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5, q8=group)
    want, want_res = fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want) and torch.equal(got_res, want_res)
    assert torch.equal(cast(torch.Tensor, silu_and_mul(_x(3, 512, 4), q8=group)), silu_and_mul(_x(3, 512, 4)))


def _linear(quantized: bool, bias: bool) -> Linear:
    lin = Linear(256, [64, 32], bias, torch.float32, CPU)
    for shard, rows in enumerate((64, 32)):
        w = _x(rows, 256, 10 + shard)
        lin.load_shard(shard, isq_weight("model.layers.0.mlp.up_proj.weight", w, resolve_qtype("q8_0"), CPU)
                       if quantized else w)
    if bias:
        assert lin.bias is not None
        lin.bias.data.copy_(_x(1, 96, 7)[0])
    return lin


@pytest.mark.parametrize(("quantized", "bias"), [(True, False), (False, True)])
def test_linear_without_q8_uses_the_dense_tensor(quantized: bool, bias: bool) -> None:
    """On the CPU no method takes codes: a Q8Activation with garbage codes gives the dense tensor's product."""
    lin = _linear(quantized, bias)
    assert isinstance(lin.methods[0], GGUFLinear) == quantized
    x = _x(4, 256, 5)
    assert lin.q8_group(4) == 0
    garbage = Q8Activation(x, torch.full((4, 256), 77, dtype=torch.int8), torch.zeros(4, 64, dtype=torch.uint8), 32)
    assert torch.equal(lin(garbage), lin(x))


def test_codes_of_another_group_are_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method that takes codes gets a Q8Activation only when its group is the one it asked for; other codes are
    dropped for the dense tensor (garbage codes would show in the product otherwise)."""
    lin = Linear(256, [64], False, torch.float32, CPU)
    lin.load_shard(0, isq_weight("model.layers.0.mlp.up_proj.weight", _x(64, 256, 12), resolve_qtype("q8_0"), CPU))
    seen: list[object] = []
    method = lin.methods[0]
    monkeypatch.setattr(method, "q8_group", lambda rows: 256)

    def forward(x: torch.Tensor | Q8Activation) -> torch.Tensor:
        seen.append(x)
        return torch.zeros(x.rows if isinstance(x, Q8Activation) else x.shape[0], 64)

    monkeypatch.setattr(method, "forward", forward)
    x = _x(4, 256, 13)
    codes, blocks = torch.zeros(4, 256, dtype=torch.int8), torch.zeros(4, 64, dtype=torch.uint8)
    lin(Q8Activation(x, codes, blocks, 32))
    lin(Q8Activation(x, codes, blocks, 256))
    assert seen[0] is x and isinstance(seen[1], Q8Activation) and seen[1].group == 256


@pytest.mark.parametrize("bad", [True, 1, 64, 512])
def test_a_group_the_kernels_do_not_take_is_refused(bad: int) -> None:
    x, w = _x(2, 256, 1), _x(1, 256, 3)[0]
    with pytest.raises(ValueError, match="scale group of 32 or 256"):
        rms_norm(x, w, 1e-5, q8=bad)
    with pytest.raises(ValueError, match="scale group of 32 or 256"):
        fused_add_rms_norm(x.clone(), x.clone(), w, 1e-5, q8=bad)
    with pytest.raises(ValueError, match="scale group of 32 or 256"):
        silu_and_mul(_x(2, 512, 4), q8=bad)


def test_fusion_switch(monkeypatch: pytest.MonkeyPatch, fresh_switch: None) -> None:
    monkeypatch.delenv("CANDLE_VLLM_Q8_FUSION", raising=False)
    assert q8_activation.fusion_enabled()
    monkeypatch.setenv("CANDLE_VLLM_Q8_FUSION", "0")
    assert q8_activation.fusion_enabled(), "read once: a later change does not apply"
    q8_activation.fusion_enabled.cache_clear()
    assert not q8_activation.fusion_enabled()


def test_dense_and_row_slice() -> None:
    x = _x(13, 64, 6)
    codes, blocks = torch.arange(13 * 64).to(torch.int8).view(13, 64), torch.zeros(13, 16, dtype=torch.uint8)
    act = Q8Activation(x, codes, blocks, 32)
    assert q8_activation.dense(act) is x and q8_activation.dense(x) is x and act.group == 32
    part = act.row_slice(8, 13)
    assert part.rows == 5 and torch.equal(part.x, x[8:]) and torch.equal(part.xq, act.xq[8:]) and part.group == 32
    assert Q8Activation(x, codes, blocks, 256).row_slice(0, 4).group == 256
