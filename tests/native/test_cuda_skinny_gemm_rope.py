"""The skinny GEMM's RoPE + cache epilogue against the two launches it replaces: the projection (same kernel,
plain weight) followed by ``rotary_embedding_cache_``. Both round the projection to the activations' dtype
before rotating and use one rotation formula, so q, k, v and the cache must agree bit for bit; the rotation
itself is checked against a float64 reference in test_cuda_layers.py."""

from __future__ import annotations

import pytest
import torch
from _cuda_helpers import poison_allocator

from candle_vllm.pyengine.ops import cuda, cuda_rotary
from candle_vllm.pyengine.ops.rotary import RopeCacheTarget
from candle_vllm.pyengine.ops.row_pairs import deinterleave_halves, interleave_halves
from candle_vllm.pyengine.quant.unquantized import UnquantizedLinear

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")



def _problem(m: int, hq: int, hk: int, d: int, k: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = (hq + 2 * hk) * d
    blocks, block_size, max_pos = 7, 16, 9000
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    slots = torch.randperm(blocks * block_size, generator=g, device=DEV)[:m]
    if m > 2:
        slots[m // 2] = -1  # a padded row: not stored
    return {
        "x": torch.randn(m, k, generator=g, device=DEV).to(dtype),
        "w": (torch.randn(n, k, generator=g, device=DEV) / k**0.5).to(dtype),
        "table": torch.cat([freqs.cos(), freqs.sin()], -1).float().to(DEV),
        "pos": torch.randint(0, max_pos, (m,), generator=g, device=DEV),
        "slots": slots,
        "cache": torch.randn(2, blocks, block_size, hk, d, generator=g, device=DEV).to(dtype),
    }


def _unfused(p: dict[str, torch.Tensor], hq: int, hk: int, d: int, splits: int | None, warps: int | None):
    y = cuda.skinny_gemm(p["x"], p["w"], splits=splits, warps=warps)
    t = y.shape[0]
    q = y[:, : hq * d].view(t, hq, d)
    k = y[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = y[:, (hq + hk) * d :].view(t, hk, d)
    cache = p["cache"].clone()
    cuda_rotary.rotary_embedding_cache_(q, k, v, p["pos"], p["table"], True, cache, p["slots"])
    return y, cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("hq,hk,d,k", [(32, 8, 128, 4096), (7, 1, 64, 320), (4, 4, 256, 520)])
@pytest.mark.parametrize("splits,warps", [(None, None), (1, 4), (3, 8)])
def test_fused_epilogue_equals_gemm_then_rotary_cache(
    dtype: torch.dtype, m: int, hq: int, hk: int, d: int, k: int, splits: int | None, warps: int | None
) -> None:
    p = _problem(m, hq, hk, d, k, dtype, seed=m * 31 + d + hq)
    want_y, want_cache = _unfused(p, hq, hk, d, splits, warps)
    cache = p["cache"].clone()
    rot_rows = (hq + hk) * d
    w = torch.cat([interleave_halves(p["w"][:rot_rows], d), p["w"][rot_rows:]])
    poison_allocator(DEV, m * w.shape[0] * 4)
    got = cuda.skinny_gemm_rope_cache(p["x"], w, d, hk, p["pos"], p["table"], cache, p["slots"], splits, warps)
    assert got is not None
    assert torch.equal(got, want_y), "q/k/v differ from the projection followed by rotary_embedding_cache_"
    assert torch.equal(cache, want_cache), "the cache differs (k, v, or a slot that should be untouched)"


@pytest.mark.parametrize("m", [1, 9])
@pytest.mark.parametrize("hq,hk,d,k", [(32, 8, 128, 4096), (7, 1, 64, 320)])
def test_fused_epilogue_into_an_e4m3_cache(m: int, hq: int, hk: int, d: int, k: int) -> None:
    """--kvcache-dtype fp8: the epilogue stores torch's e4m3 cast (saturated at 448) of what it stores into a bf16
    cache, and leaves y as it is."""
    p = _problem(m, hq, hk, d, k, torch.bfloat16, seed=m + d)
    p["x"] = p["x"] * 300  # some k/v values past 448
    rot_rows = (hq + hk) * d
    w = torch.cat([interleave_halves(p["w"][:rot_rows], d), p["w"][rot_rows:]])
    caches = {}
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = p["cache"].float().clamp(-448, 448).to(kv_dtype)
        y = cuda.skinny_gemm_rope_cache(p["x"], w, d, hk, p["pos"], p["table"], cache, p["slots"])
        assert y is not None
        caches[kv_dtype] = (y, cache)
    (y_bf16, bf16), (y_e4m3, e4m3) = caches[torch.bfloat16], caches[torch.float8_e4m3fn]
    assert torch.equal(y_e4m3, y_bf16)
    assert (bf16.float().abs() > 448).any(), "the case must store values past e4m3's range"
    want = bf16.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(e4m3.view(torch.uint8), want.view(torch.uint8))


def test_dense_method_stores_halves_interleaved_and_keeps_its_output() -> None:
    hq, hk, d, k = 6, 2, 128, 256
    p = _problem(4, hq, hk, d, k, torch.bfloat16, seed=5)
    rot_rows = (hq + hk) * d
    plain, fused = UnquantizedLinear(p["w"].clone()), UnquantizedLinear(p["w"].clone(), rope_rows=rot_rows, head_dim=d)
    assert not torch.equal(fused.weight, plain.weight) and fused.rope_pair_group == 8
    for rows in (4, 40):  # the skinny GEMM and cuBLAS: q/k heads in the paired layout, v as it is
        x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
        got, want = fused(x), plain(x)
        heads = deinterleave_halves(got[:, :rot_rows].reshape(rows, hq + hk, d), d).reshape(rows, rot_rows)
        assert torch.equal(heads, want[:, :rot_rows]) and torch.equal(got[:, rot_rows:], want[:, rot_rows:])
    want_y, want_cache = _unfused(p, hq, hk, d, None, None)
    cache = p["cache"].clone()
    target = RopeCacheTarget(hk, p["pos"], p["table"], cache, p["slots"])
    got = fused.forward_rope_cache(p["x"], target)
    assert got is not None and torch.equal(got, want_y) and torch.equal(cache, want_cache)
    assert plain.forward_rope_cache(p["x"], target) is None
    big = torch.randn(17, k, device=DEV, dtype=torch.bfloat16)  # above the skinny GEMM's 16 rows
    slots17, pos17 = torch.arange(17, device=DEV), torch.arange(17, device=DEV)
    assert fused.forward_rope_cache(big, RopeCacheTarget(hk, pos17, p["table"], cache, slots17)) is None


def test_fused_epilogue_refuses_what_it_cannot_do() -> None:
    hq, hk, d, k = 4, 2, 64, 128
    p = _problem(2, hq, hk, d, k, torch.bfloat16, seed=9)
    partial_table = p["table"][:, : d // 2].contiguous()  # partial rotary
    assert cuda.skinny_gemm_rope_cache(p["x"], p["w"], d, hk, p["pos"], partial_table, p["cache"], p["slots"]) is None
    f16_cache = p["cache"].half()
    assert cuda.skinny_gemm_rope_cache(p["x"], p["w"], d, hk, p["pos"], p["table"], f16_cache, p["slots"]) is None
    assert cuda.skinny_gemm_rope_cache(p["x"], p["w"], 72, hk, p["pos"], p["table"], p["cache"], p["slots"]) is None


def _paired(y: torch.Tensor, rot_rows: int, d: int, group: int = 8) -> torch.Tensor:
    """y [T, N] with the first rot_rows features' heads stored as halves interleaved in groups of ``group``."""
    t = y.shape[0]
    heads = interleave_halves(y[:, :rot_rows].reshape(-1, d).T.contiguous(), d, group).T.reshape(t, rot_rows)
    return torch.cat([heads, y[:, rot_rows:]], dim=1).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("group", [8, 1])
def test_paired_rotary_kernels_equal_the_standard_ones(
    dtype: torch.dtype, d: int, tokens: int, with_cache: bool, group: int
) -> None:
    """The prefill/large-batch path of a paired q/k/v weight (group 8: the dense skinny GEMM's layout, 1: the GGUF
    GEMV's): the RoPE kernels read the interleaved halves and leave q/k (and the cache) exactly as the standard
    kernels leave the standard layout."""
    hq, hk = 5, 3
    p = _problem(min(tokens, 16), hq, hk, d, 64, dtype, seed=d + tokens)
    g = torch.Generator(device=DEV).manual_seed(tokens)
    n, rot_rows = (hq + 2 * hk) * d, (hq + hk) * d
    y = torch.randn(tokens, n, generator=g, device=DEV).to(dtype)
    pos = torch.randint(0, p["table"].shape[0], (tokens,), generator=g, device=DEV)
    slots = torch.randperm(tokens * 2, generator=g, device=DEV)[:tokens]
    cache = torch.randn(2, tokens * 2, 1, hk, d, generator=g, device=DEV).to(dtype)
    runs = []
    for layout, pair_group in ((y.clone(), 0), (_paired(y, rot_rows, d, group), group)):
        q = layout[:, : hq * d].view(tokens, hq, d)
        k = layout[:, hq * d : rot_rows].view(tokens, hk, d)
        v = layout[:, rot_rows:].view(tokens, hk, d)
        c = cache.clone()
        if with_cache:
            cuda_rotary.rotary_embedding_cache_(q, k, v, pos, p["table"], True, c, slots, pair_group=pair_group)
        else:
            cuda_rotary.rotary_embedding_(q, k, pos, p["table"], True, pair_group=pair_group)
        runs.append((layout, c))
    assert torch.equal(runs[1][0], runs[0][0]), "paired q/k were not left rotated in the standard layout"
    assert torch.equal(runs[1][1], runs[0][1])


def test_paired_rotary_refuses_what_it_cannot_do() -> None:
    q, k = torch.randn(3, 2, 96, device=DEV).bfloat16(), torch.randn(3, 1, 96, device=DEV).bfloat16()
    table, pos = torch.randn(10, 96, device=DEV), torch.arange(3, device=DEV)
    assert cuda_rotary.rotary_supported(q, k, pos, table)
    assert not cuda_rotary.rotary_supported(q, k, pos, table, pair_group=8)
    q128, k128 = torch.randn(3, 2, 128, device=DEV).bfloat16(), torch.randn(3, 1, 128, device=DEV).bfloat16()
    table128 = torch.randn(10, 128, device=DEV)
    assert cuda_rotary.rotary_supported(q128, k128, pos, table128, pair_group=1)
    assert not cuda_rotary.rotary_supported(q128, k128, pos, table128, pair_group=4)  # no kernel for groups of 4
    with pytest.raises(ValueError, match="neox"):
        cuda_rotary.rotary_embedding_(q128, k128, pos, table128, False, pair_group=1)
    assert not cuda_rotary.rope_paired_head_dim_ok(96) and cuda_rotary.rope_paired_head_dim_ok(128)
