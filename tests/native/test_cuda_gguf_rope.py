"""The GGUF RoPE + cache epilogue (``cuda_gguf.gemv_rope_cache``, on the dp4a GEMV and on the int8 tensor-core
product) against what it replaces.

Oracles:
- bit for bit: the GEMV on the same paired blocks followed by ``rotary_embedding_cache_(pair_group=1)``, and the
  GEMV on the blocks in their file order followed by the standard ``rotary_embedding_cache_`` (a row's sum does
  not depend on where the row sits), for y and the whole cache (slots < 0 and unused slots untouched);
- the same bits for every one-token rows choice (2/4/8) and for codes a producer wrote (``Q8Activation``);
- a float64 torch reference (``gguf.quants.dequantize`` + matmul + RoPE) within the int8-activation error;
- a tiny random Llama with ``--isq q4k`` through ``LLM.generate``: greedy tokens and logprobs identical with the
  fusion on and off (``CANDLE_VLLM_GGUF_ROPE=0``), and the fused kernel really runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from _cuda_helpers import poison_allocator, rel_error, write_tiny_model_dir
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.ops import cuda_gguf, cuda_rotary, native
from candle_vllm.pyengine.ops.norm import rms_norm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation
from candle_vllm.pyengine.ops.quant import takes_tensor_cores
from candle_vllm.pyengine.ops.rotary import RopeCacheTarget
from candle_vllm.pyengine.ops.row_pairs import interleave_halves
from candle_vllm.pyengine.quant import gguf as gguf_quant
from candle_vllm.pyengine.quant.base import build_linear_methods
from candle_vllm.pyengine.quant.gguf import GGUFLinear, GGUFWeight
from candle_vllm.pyengine.quant.isq import quantize

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
# ||fused - f64 reference|| / ||reference||: x rounded to int8 per 32 values (~0.5 % rms; per 256 for the K-quants on
# tensor cores, ~0.7 %) plus the output rounding.
REF_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 1e-2}



@functools.cache
def _weight(qtype: QT, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random W [n, k] as ISQ blocks (on the GPU) and the gguf package's float64 decoding of those blocks."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k + int(qtype))) / k**0.5
    blocks = quantize(w.to(DEV), qtype)
    decoded = torch.from_numpy(gguf_dequantize(blocks.cpu().numpy(), qtype).astype(np.float64)).reshape(n, k)
    return blocks, decoded


def _problem(qtype: QT, m: int, hq: int, hk: int, d: int, k: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n, blocks, block_size, max_pos = (hq + 2 * hk) * d, 5, 16, 4000
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    slots = torch.randperm(blocks * block_size, generator=g)[:m]
    slots[torch.rand(m, generator=g) < 0.3] = -1  # padded rows: not stored
    return {
        "qtype": qtype, "hq": hq, "hk": hk, "d": d, "n": n, "k": k, "rot": (hq + hk) * d,
        "blocks": _weight(qtype, n, k)[0], "w64": _weight(qtype, n, k)[1],
        "x": torch.randn(m, k, generator=g).to(dtype).to(DEV),
        "table64": torch.cat([freqs.cos(), freqs.sin()], -1),
        "table": torch.cat([freqs.cos(), freqs.sin()], -1).float().to(DEV),
        "pos": torch.randint(0, max_pos, (m,), generator=g).to(DEV),
        "slots": slots.to(DEV),
        "cache": torch.randn(2, blocks, block_size, hk, d, generator=g).to(dtype).to(DEV),
    }


def _paired_blocks(p: dict) -> torch.Tensor:
    return torch.cat([interleave_halves(p["blocks"][: p["rot"]], p["d"], 1), p["blocks"][p["rot"] :]])


def _on_device(p: dict, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks (ISQ's, or paired from them) in the layout the CUDA kernels read."""
    return cuda_gguf.device_layout(blocks, p["qtype"], p["n"], p["k"])


def _gemv_then_rotary(p: dict, blocks: torch.Tensor, pair_group: int,
                      tensor_cores: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    product = cuda_gguf.mmq if tensor_cores else cuda_gguf.gemv
    y = product(p["x"], _on_device(p, blocks), p["qtype"], p["n"], p["k"])
    t, d, hq, hk = y.shape[0], p["d"], p["hq"], p["hk"]
    q, k, v = y[:, : hq * d].view(t, hq, d), y[:, hq * d : p["rot"]].view(t, hk, d), y[:, p["rot"] :].view(t, hk, d)
    cache = p["cache"].clone()
    cuda_rotary.rotary_embedding_cache_(q, k, v, p["pos"], p["table"], True, cache, p["slots"], pair_group=pair_group)
    return y, cache


def _fused(p: dict, x: torch.Tensor | Q8Activation, blocks: torch.Tensor, rows: int = 0, tensor_cores: bool = False):
    cache = p["cache"].clone()
    poison_allocator(DEV, p["x"].shape[0] * p["n"])
    y = cuda_gguf.gemv_rope_cache(x, _on_device(p, blocks), p["qtype"], p["n"], p["k"], p["d"], p["hk"], p["pos"], p["table"],
                                  cache, p["slots"], rows=rows, tensor_cores=tensor_cores)
    assert y is not None, "the fused kernel refused a supported problem"
    return y, cache


def _reference(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: dequantized W (gguf package) times x, neox RoPE on q/k; y and the k/v rows meant for the cache."""
    y = p["x"].cpu().double() @ p["w64"].T
    t, d = y.shape[0], p["d"]
    heads = y[:, : p["rot"]].reshape(t, -1, d)
    cos, sin = p["table64"][p["pos"].cpu()].unsqueeze(1).chunk(2, dim=-1)
    a, b = heads.chunk(2, dim=-1)
    y[:, : p["rot"]] = torch.cat([a * cos - b * sin, b * cos + a * sin], -1).reshape(t, -1)
    return y, y[:, p["hq"] * d :].reshape(t, 2, p["hk"], d)


# K = 8192: a one-token Q4_K GEMV over rows longer than one pass runs the pipelined loop, the fused kernel the plain
# one; both must sum in the same order. Q2_K's one- and two-token launches (fused or not) and Q4_0/Q4_1's two-token
# 8-row ones run the row-by-row loop (Q5_1's two-token default on rows longer than 8192, R = 2, is the rows = 2
# case here).
SHAPES = [(32, 8, 128, 4096), (6, 2, 64, 512), (3, 1, 256, 768), (4, 2, 64, 8192)]


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.Q6_K, QT.Q3_K, QT.Q2_K, QT.Q4_0, QT.Q4_1, QT.Q5_1],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("hq,hk,d,k", SHAPES)
def test_fused_equals_gemv_then_rotary_cache(qtype: QT, m: int, dtype: torch.dtype, hq: int, hk: int, d: int,
                                            k: int) -> None:
    p = _problem(qtype, m, hq, hk, d, k, dtype, seed=m * 97 + d + int(qtype))
    paired = _paired_blocks(p)
    want_y, want_cache = _gemv_then_rotary(p, paired, 1)
    std_y, std_cache = _gemv_then_rotary(p, p["blocks"], 0)
    assert torch.equal(want_y, std_y) and torch.equal(want_cache, std_cache), "paired RoPE != standard RoPE"
    for rows in ([0, 2, 4, 8] if m <= 2 else [0, 2, 4]):
        got_y, got_cache = _fused(p, p["x"], paired, rows)
        assert torch.equal(got_y, want_y), f"rows={rows}: y differs from the GEMV + rotary_embedding_cache_"
        assert torch.equal(got_cache, want_cache), f"rows={rows}: the cache differs (k, v or an untouched slot)"
    ref_y, ref_kv = _reference(p)
    assert rel_error(got_y, ref_y) < REF_TOL[dtype]
    stored = p["slots"] >= 0
    if stored.any():
        kv = got_cache.view(2, -1, hk, d)[:, p["slots"][stored]].transpose(0, 1)
        assert rel_error(kv, ref_kv[stored.cpu()]) < REF_TOL[dtype]


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["dp4a", "mmq"])
@pytest.mark.parametrize("m", [1, 8])
def test_fused_epilogue_into_an_e4m3_cache(m: int, tensor_cores: bool) -> None:
    """--kvcache-dtype fp8: the dp4a GEMV's and the tensor-core product's epilogue store torch's e4m3 cast of what
    they store into a bf16 cache (untouched slots keep their bytes), y unchanged."""
    p = _problem(QT.Q4_K, m, 32, 8, 128, 4096, torch.bfloat16, seed=m + 5)
    paired = _paired_blocks(p)
    p["cache"] = p["cache"].float().clamp(-448, 448).to(torch.bfloat16)
    want_y, bf16 = _fused(p, p["x"], paired, tensor_cores=tensor_cores)
    p["cache"] = p["cache"].to(torch.float8_e4m3fn)
    got_y, e4m3 = _fused(p, p["x"], paired, tensor_cores=tensor_cores)
    assert torch.equal(got_y, want_y)
    want = bf16.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(e4m3.view(torch.uint8), want.view(torch.uint8))


EPILOGUE_TYPES = [QT.Q4_K, QT.Q8_0, QT.Q6_K, QT.Q4_0, QT.Q5_0, QT.Q2_K, QT.Q3_K, QT.Q4_1, QT.Q5_1, QT.Q5_K]


@pytest.mark.parametrize("qtype", EPILOGUE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [3, 9, 17, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("hq,hk,d,k", SHAPES)
def test_tensor_core_epilogue_equals_mmq_then_rotary_cache(qtype: QT, m: int, dtype: torch.dtype, hq: int, hk: int,
                                                          d: int, k: int) -> None:
    """The same epilogue on the int8 tensor-core product (up to 32 tokens): the bits of cuda_gguf.mmq followed by
    rotary_embedding_cache_, the float64 reference within the int8-activation error."""
    p = _problem(qtype, m, hq, hk, d, k, dtype, seed=m * 89 + d + int(qtype))
    paired = _paired_blocks(p)
    want_y, want_cache = _gemv_then_rotary(p, paired, 1, tensor_cores=True)
    got_y, got_cache = _fused(p, p["x"], paired, tensor_cores=True)
    assert torch.equal(got_y, want_y), "y differs from mmq + rotary_embedding_cache_"
    assert torch.equal(got_cache, want_cache), "the cache differs (k, v or an untouched slot)"
    assert rel_error(got_y, _reference(p)[0]) < REF_TOL[dtype]


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "tensor_cores"), [(1, False), (5, False), (5, True), (17, True)])
def test_producer_codes_give_the_same_bits(qtype: QT, m: int, tensor_cores: bool) -> None:
    """x handed over with the int8 codes its RMSNorm wrote: no quantizer launch, the same y and cache, on the dp4a
    GEMV and on the tensor-core product (whose codes must come with 16-byte aligned XBlocks, else it quantizes x
    again: a misaligned view covers that path)."""
    p = _problem(qtype, m, 8, 2, 128, 1024, torch.bfloat16, seed=m)
    norm_w = (torch.rand(p["k"], generator=torch.Generator().manual_seed(1)) + 0.5).to(torch.bfloat16).to(DEV)
    group = cuda_gguf.x_group(qtype) if tensor_cores else 32
    act = rms_norm(p["x"], norm_w, 1e-5, q8=group)
    assert isinstance(act, Q8Activation)
    p["x"] = act.x
    paired = _paired_blocks(p)
    want = _fused(p, act.x, paired, tensor_cores=tensor_cores)
    got = _fused(p, act, paired, tensor_cores=tensor_cores)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if tensor_cores:  # codes whose XBlocks start 8 bytes off 16: quantized again, the same bits
        xb = torch.cat([act.xb.new_zeros(8), act.xb.reshape(-1)])[8:].view_as(act.xb)
        shifted = Q8Activation(act.x, act.xq, xb, group)
        assert shifted.xb.data_ptr() % 16 != 0
        moved = _fused(p, shifted, paired, tensor_cores=True)
        assert torch.equal(moved[0], want[0]) and torch.equal(moved[1], want[1])


def test_refuses_what_it_cannot_do() -> None:
    p = _problem(QT.Q4_K, 2, 4, 2, 64, 256, torch.bfloat16, seed=3)
    args = (p["blocks"], p["qtype"], p["n"], p["k"], p["d"], p["hk"], p["pos"])
    half_table = p["table"][:, :32].contiguous()  # partial rotary
    assert cuda_gguf.gemv_rope_cache(p["x"], *args, half_table, p["cache"], p["slots"]) is None
    assert cuda_gguf.gemv_rope_cache(p["x"], *args, p["table"], p["cache"].half(), p["slots"]) is None
    nine, nine_ids = torch.randn(9, p["k"], device=DEV).bfloat16(), torch.arange(9, device=DEV)  # above 8 rows
    assert cuda_gguf.gemv_rope_cache(nine, *args[:-1], nine_ids, p["table"], p["cache"], nine_ids) is None
    many, many_ids = torch.randn(33, p["k"], device=DEV).bfloat16(), torch.arange(33, device=DEV)  # above 32 rows
    assert cuda_gguf.gemv_rope_cache(many, *args[:-1], many_ids, p["table"], p["cache"], many_ids,
                                     tensor_cores=True) is None
    assert cuda_gguf.gemv_rope_cache(p["x"], *args, p["table"], p["cache"], p["slots"], rows=2,  # a dp4a choice
                                     tensor_cores=True) is None
    bad_heads = (p["blocks"], p["qtype"], p["n"], p["k"], 96, p["hk"], p["pos"])  # N is no whole number of heads
    assert cuda_gguf.gemv_rope_cache(p["x"], *bad_heads, p["table"], p["cache"], p["slots"]) is None


@pytest.fixture
def gguf_rope(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], None]]:
    """Sets CANDLE_VLLM_GGUF_ROPE (read once per process) and forgets the cached value before and after."""

    def set_rope(on: bool) -> None:
        monkeypatch.setenv("CANDLE_VLLM_GGUF_ROPE", "1" if on else "0")
        gguf_quant.rope_epilogue_enabled.cache_clear()

    yield set_rope
    monkeypatch.delenv("CANDLE_VLLM_GGUF_ROPE", raising=False)
    gguf_quant.rope_epilogue_enabled.cache_clear()


def test_method_stores_pairs_only_where_the_epilogue_runs(gguf_rope: Callable[[bool], None]) -> None:
    p = _problem(QT.Q4_K, 3, 4, 2, 128, 512, torch.bfloat16, seed=8)
    shards = [GGUFWeight(b, QT.Q4_K, (b.shape[0], p["k"])) for b in p["blocks"].split([512, 256, 256])]
    gguf_rope(True)
    (fused,) = build_linear_methods(shards, torch.bfloat16, DEV, rope_head_dim=p["d"])
    assert isinstance(fused, GGUFLinear) and fused.rope_pair_group == 1
    assert torch.equal(fused.data, _paired_blocks(p))
    tensor_cores = takes_tensor_cores(QT.Q4_K, p["x"].shape[0], p["n"], p["k"])
    want_y, want_cache = _gemv_then_rotary(p, fused.data, 1, tensor_cores=tensor_cores)
    cache = p["cache"].clone()
    got = fused.forward_rope_cache(p["x"], RopeCacheTarget(p["hk"], p["pos"], p["table"], cache, p["slots"]))
    assert got is not None and torch.equal(got, want_y) and torch.equal(cache, want_cache)
    product = cuda_gguf.mmq if tensor_cores else cuda_gguf.gemv
    assert torch.equal(fused(p["x"]), product(p["x"], fused.data, QT.Q4_K, p["n"], p["k"]))
    gguf_rope(False)
    (plain,) = build_linear_methods(shards, torch.bfloat16, DEV, rope_head_dim=p["d"])
    assert plain.rope_pair_group == 0 and torch.equal(cast(torch.Tensor, plain.data), p["blocks"])
    assert plain.forward_rope_cache(p["x"], RopeCacheTarget(p["hk"], p["pos"], p["table"], cache, p["slots"])) is None


TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}


@contextlib.contextmanager
def _counting(name: str) -> Iterator[list[int]]:
    """Counts the calls of one native function (still running it) inside the block."""
    mod, count = native.module(), [0]
    real = getattr(mod, name)

    def counted(*args: object, **kwargs: object) -> None:
        count[0] += 1
        real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, name, counted)
        yield count


def test_engine_greedy_equal_with_and_without_the_epilogue(
    tmp_path: Path, gguf_rope: Callable[[bool], None]
) -> None:
    """--isq q4k through LLM.generate with decode CUDA graphs (batches of 1-4 sequences): same tokens and logprobs."""
    model = str(write_tiny_model_dir(tmp_path, TINY_LLAMA, TINY_LLAMA["vocab_size"]))
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, 512, (int(n),), generator=g).tolist()} for n in (6, 19, 3, 11)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs, calls = {}, {}
    for on in (True, False):
        gguf_rope(on)
        with _counting("cuda_gguf_gemv_q8_rope_cache") as count:
            llm = LLM(model=model, load_format="dummy", isq="q4k", dtype="bf16", mem=64, max_num_seqs=8, seed=0)
            assert llm.engine.runner.graphs is not None, "decode should run inside CUDA graphs"
            outs[on] = llm.generate(prompts, params)
            single = llm.generate(prompts[:1], params)  # batch-1 decode too
            outs[on] = [*outs[on], *single]
        calls[on] = count[0]
        del llm
    assert calls[True] > 0 and calls[False] == 0, calls
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        logprobs_a, logprobs_b = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert logprobs_a is not None and logprobs_b is not None
        for la, lb in zip(logprobs_a, logprobs_b, strict=True):
            assert {k: v.logprob for k, v in la.items()} == {k: v.logprob for k, v in lb.items()}
