"""Int8 activation codes written by RMSNorm / fused add+RMSNorm / SiLU-and-mul for the GGUF int8 kernels
(``ops/q8_activation.py``, ``native/cuda/q8_activation.cuh``), one scale per 32 values (the dp4a GEMV) or per 256
(the K-quants' tensor-core product).

Oracles:
- the producers' dense output equals the plain kernel's, bit for bit (the codes are an extra output);
- the codes and blocks equal a torch re-implementation of the rule (per group of 32 or 256 values: amax, IEEE
  127 / amax, codes trunc(v * inv +- 0.5), scale amax / 127 in every 32-value block of the group, int sums of each
  block's two 16-value halves), on random data plus blocks that hit the corner cases (an all-zero block, exact
  ties);
- the codes equal the bytes the kernels' own quantizer writes into its scratch for the same dense values (the
  dp4a GEMV's for 32, the K-quant tensor-core product's for 256), so the product on pre-quantized activations
  equals the product on the dense tensor bit for bit (q4k, q8_0, q4_0, q6k; 1, 3, 8 and 13 rows, 13 being two
  8-row passes or one launch of the tensor-core product, whose K-quant codes are per 256);
- a tiny random Llama with ISQ weights: logits and greedy tokens (CUDA graphs included) identical with the fusion
  on and off (CANDLE_VLLM_Q8_FUSION=0), and the fused run really skips the quantizer launches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from _cuda_helpers import write_tiny_model_dir
from gguf import GGMLQuantizationType as QT

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.config import config_from_hf_dict
from candle_vllm.pyengine.loader.dummy import dummy_weights
from candle_vllm.pyengine.models.llama import LlamaForCausalLM
from candle_vllm.pyengine.ops import cuda_gguf, native, q8_activation, quant
from candle_vllm.pyengine.ops.activation import silu_and_mul
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.ops.norm import fused_add_rms_norm, rms_norm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation
from candle_vllm.pyengine.quant.isq import isq_weight, quantize

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
EPS = 1e-5
ROWS = [1, 3, 8, 13]
GEMV_TYPES = [QT.Q4_K, QT.Q8_0, QT.Q4_0, QT.Q6_K]
VOCAB = 512
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}



@pytest.fixture
def fusion(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], None]]:
    """Sets CANDLE_VLLM_Q8_FUSION (read once per process) and forgets the cached value before and after."""

    def set_fusion(on: bool) -> None:
        monkeypatch.setenv("CANDLE_VLLM_Q8_FUSION", "1" if on else "0")
        q8_activation.fusion_enabled.cache_clear()

    yield set_fusion
    monkeypatch.delenv("CANDLE_VLLM_Q8_FUSION", raising=False)
    q8_activation.fusion_enabled.cache_clear()


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def reference_codes(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], scales f32 [M, K/32], half sums int [M, K/32, 2]) by the rule with one
    scale per ``group`` values, on the CPU with tensor/tensor divisions (IEEE; torch's division by a Python scalar
    may multiply by a reciprocal)."""
    m, k = x.shape
    xf = x.cpu().float().view(m, k // group, group)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    scaled = xf * inv
    codes = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5)).to(torch.int32)
    d = (amax / torch.full_like(amax, 127.0)).expand(m, k // group, group // 32).reshape(m, k // 32)
    return codes.to(torch.int8).view(m, k), d, codes.view(m, k // 32, 2, 16).sum(-1)


def unpack_blocks(xb: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The native XBlocks (f32 scale, two int16 sums) of [m, k] activations as (scales, sums)."""
    raw = xb.cpu().view(m, k // 32, 8)
    return raw[..., :4].contiguous().view(torch.float32).squeeze(-1), raw[..., 4:].contiguous().view(torch.int16)


def assert_codes_follow_rule(act: Q8Activation) -> None:
    x = act.x.reshape(-1, act.x.shape[-1])
    m, k = x.shape
    want_q, want_d, want_sums = reference_codes(x, act.group)
    got_d, got_sums = unpack_blocks(act.xb, m, k)
    assert torch.equal(act.xq.cpu(), want_q), f"{int((act.xq.cpu() != want_q).sum())} codes differ"
    assert torch.equal(got_d, want_d), "block scales differ"
    assert torch.equal(got_sums.to(torch.int32), want_sums.to(torch.int32)), "half sums differ"


def quantizer_bytes(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and blocks the kernels' own quantizer writes for x [M <= 32, K] (read back from its scratch): the
    dp4a GEMV's (q8_0 weight) for group 32, the tensor-core product's for a K-quant (q4k weight) for group 256."""
    m, k = x.shape
    w = quantize(_randn(16, k, dtype=torch.float32, seed=1), "q8_0" if group == 32 else "q4k")
    mod = native.loaded()
    xq = torch.empty(m, k, dtype=torch.int8, device=DEV)
    xb = torch.empty(m, k // 32 * mod.cuda_gguf_xblock_bytes, dtype=torch.uint8, device=DEV)
    y = torch.empty(m, 16, dtype=x.dtype, device=DEV)
    if group == 256:
        mod.cuda_gguf_mmq(y.data_ptr(), x.data_ptr(), xq.data_ptr(), xb.data_ptr(), w.data_ptr(), m, 16, k,
                          int(QT.Q4_K), native.dtype_code(x), native.stream(DEV), 0, 0)
        return xq, xb
    for at in range(0, m, 8):  # the GEMV takes up to 8 rows
        rows = min(8, m - at)
        mod.cuda_gguf_gemv_q8(
            y.data_ptr(), x[at:].data_ptr(), xq[at:].data_ptr(), xb[at:].data_ptr(), w.data_ptr(), rows, 16, k,
            int(QT.Q8_0), native.dtype_code(x), native.stream(DEV),
        )
    return xq, xb


def assert_codes_equal_own_quantizer(act: Q8Activation) -> None:
    xq, xb = quantizer_bytes(act.x.reshape(-1, act.x.shape[-1]), act.group)
    assert torch.equal(act.xq, xq), "codes differ from the kernels' quantizer's"
    assert torch.equal(act.xb, xb), "blocks differ from the kernels' quantizer's"


def groups_for(k: int) -> list[int]:
    return [g for g in (32, 256) if k % g == 0]


def with_zero_block(x: torch.Tensor) -> torch.Tensor:
    """Row 0's first 32 values and row 1's first 256 (where there is a row 1) set to 0: a block and a 256-value run
    with amax 0 (scale 0 and zero codes, no division by zero)."""
    x = x.clone()
    x[0, :32] = 0
    x[1:2, :256] = 0
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [4096, 1056, 8448])  # 8448: two trips of 1024 threads, the second partial
def test_rms_norm_codes(dtype: torch.dtype, hidden: int) -> None:
    for m in ROWS:
        x = with_zero_block(_randn(m, hidden, dtype=dtype, seed=m))
        w = _randn(hidden, dtype=dtype, seed=99, scale=0.5)
        for group in groups_for(hidden):
            act = rms_norm(x, w, EPS, q8=group)
            assert isinstance(act, Q8Activation) and act.group == group
            assert torch.equal(act.x, rms_norm(x, w, EPS)), "the dense output changed"
            assert_codes_follow_rule(act)
            assert_codes_equal_own_quantizer(act)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [4096, 1056, 8448])
def test_fused_add_rms_norm_codes(dtype: torch.dtype, hidden: int) -> None:
    for m in ROWS:
        x, res = _randn(m, hidden, dtype=dtype, seed=m), _randn(m, hidden, dtype=dtype, seed=50 + m)
        w = _randn(hidden, dtype=dtype, seed=98, scale=0.5)
        want_x, want_res = fused_add_rms_norm(x.clone(), res.clone(), w, EPS)
        for group in groups_for(hidden):
            act, got_res = fused_add_rms_norm(x.clone(), res.clone(), w, EPS, q8=group)
            assert isinstance(act, Q8Activation) and act.group == group
            assert torch.equal(act.x, want_x) and torch.equal(got_res, want_res), "the dense outputs changed"
            assert_codes_follow_rule(act)
            assert_codes_equal_own_quantizer(act)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [4096, 1056, 14336])
def test_silu_and_mul_codes(dtype: torch.dtype, d: int) -> None:
    for m in ROWS:
        x = _randn(m, 2 * d, dtype=dtype, seed=m, scale=2.0)
        for group in groups_for(d):
            act = silu_and_mul(x, q8=group)
            assert isinstance(act, Q8Activation) and act.group == group
            assert torch.equal(act.x, silu_and_mul(x)), "the dense output changed"
            assert_codes_follow_rule(act)
            assert_codes_equal_own_quantizer(act)


def test_corner_blocks_follow_the_rule() -> None:
    """A zero block -> zero codes and scale; exact ties round away from zero. silu(32) is 32 in f32, so the output
    is 32 * up exactly; a block of up holding +-127 has amax 4064 and inv exactly 1/32, and up's halves
    (2.5, -0.5, ...) land on ties (2.5 -> 3, -0.5 -> -1)."""
    up = with_zero_block(_randn(2, 256, dtype=torch.bfloat16, seed=3))
    ties = torch.tensor([127.0, -127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5] * 4, dtype=up.dtype, device=DEV)
    up[0, 32:64] = ties
    act = silu_and_mul(torch.cat([torch.full_like(up, 32.0), up], dim=-1), q8=32)
    assert isinstance(act, Q8Activation)
    assert torch.equal(act.x[0, 32:64], 32 * ties)
    got_d, _ = unpack_blocks(act.xb, 2, 256)
    assert (act.xq[0, :32] == 0).all() and got_d[0, 0] == 0
    want = torch.tensor([127, -127, 3, -3, 1, -1, 2, -2] * 4, dtype=torch.int8)
    assert torch.equal(act.xq[0, 32:64].cpu(), want)
    assert_codes_follow_rule(act)


def test_unsupported_shapes_return_plain_tensors() -> None:
    """q8 is a request: f32 rows, rows not a multiple of the group and CPU tensors give today's plain output; a
    group the kernels do not take is refused."""
    x32 = _randn(2, 256, dtype=torch.float32, seed=1)
    assert isinstance(rms_norm(x32, torch.ones(256, device=DEV), EPS, q8=32), torch.Tensor)
    xodd = _randn(2, 2 * 48, dtype=torch.bfloat16, seed=2)
    assert isinstance(silu_and_mul(xodd, q8=32), torch.Tensor)
    x1056 = _randn(2, 1056, dtype=torch.bfloat16, seed=4)
    assert isinstance(rms_norm(x1056, torch.ones(1056, device=DEV, dtype=torch.bfloat16), EPS, q8=256), torch.Tensor)
    with pytest.raises(ValueError, match="scale group of 32 or 256"):
        rms_norm(x1056, torch.ones(1056, device=DEV, dtype=torch.bfloat16), EPS, q8=64)
    xcpu = torch.randn(2, 256, dtype=torch.bfloat16)
    assert isinstance(rms_norm(xcpu, torch.ones(256, dtype=torch.bfloat16), EPS, q8=32), torch.Tensor)


# The int8-activation launches that quantize x themselves, and those that read codes a producer wrote (the
# tensor-core product is one binding for both: x = 0 means codes).
QUANTIZER_CALLS = ("cuda_gguf_gemv_q8", "cuda_gguf_mmq(x)")
CODE_CALLS = ("cuda_gguf_gemv_q8_quantized", "cuda_gguf_mmq(codes)")


def launches(qtype: QT, rows: int, n: int, k: int) -> int:
    """Int8-activation launches ops.quant makes for ``rows`` rows of an [n, k] weight: one tensor-core product, or
    8-row GEMV passes."""
    mod = native.loaded()
    mmq = (
        quant.mmq_enabled() and mod.cuda_gguf_mmq_supported(int(qtype)) and k % 256 == 0
        and cast(int, quant.mmq_min_rows(qtype, n, k)) <= rows <= mod.cuda_gguf_mmq_max_m
    )
    return 1 if mmq else -(-rows // 8)


@contextlib.contextmanager
def counting(*names: str) -> Iterator[dict[str, int]]:
    """Counts the calls of native functions (still running them) inside the block; "cuda_gguf_mmq(x)" and
    "cuda_gguf_mmq(codes)" count that binding's calls with and without a dense x to quantize."""
    mod, counts = native.module(), dict.fromkeys(names, 0)
    with pytest.MonkeyPatch.context() as mp:
        for name in dict.fromkeys(n.split("(")[0] for n in names):
            real = getattr(mod, name)

            def counted(*args: object, _real: Callable[..., None] = real, _name: str = name) -> None:
                key = _name if _name != "cuda_gguf_mmq" else f"{_name}({'x' if args[1] else 'codes'})"
                if key in counts:
                    counts[key] += 1
                _real(*args)

            mp.setattr(mod, name, counted)
        yield counts


@pytest.mark.parametrize("qtype", GEMV_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("hidden", [4096, 1056])
def test_gemv_on_codes_equals_gemv_on_dense(qtype: QT, hidden: int) -> None:
    if hidden % 256 and qtype in (QT.Q4_K, QT.Q6_K):
        pytest.skip("K-quant rows are whole 256-value super-blocks")
    n = 300
    blocks = quantize(_randn(n, hidden, dtype=torch.float32, seed=int(qtype)), qtype)
    data = cuda_gguf.device_layout(blocks, qtype, n, hidden)
    w = _randn(hidden, dtype=torch.bfloat16, seed=7, scale=0.5)
    for m in ROWS:
        group = quant.q8_group(qtype, m, n, hidden)  # the product's: 256 where a K-quant takes the tensor cores
        act = rms_norm(_randn(m, hidden, dtype=torch.bfloat16, seed=m), w, EPS, q8=group)
        assert isinstance(act, Q8Activation) and act.group == group
        want = quant.quant_matmul(act.x, data, qtype, n, hidden)
        with counting(*QUANTIZER_CALLS, *CODE_CALLS) as counts:
            got = quant.quant_matmul(act, data, qtype, n, hidden)
        assert sum(counts[c] for c in QUANTIZER_CALLS) == 0, counts
        assert sum(counts[c] for c in CODE_CALLS) == launches(qtype, m, n, hidden), counts
        assert torch.equal(got, want), f"M={m}: max |diff| {(got.float() - want.float()).abs().max()}"


def _tiny_llama(qtype: QT) -> LlamaForCausalLM:
    cfg = config_from_hf_dict(TINY_LLAMA)
    model = LlamaForCausalLM(cfg, torch.bfloat16, DEV)
    weights = dummy_weights(model.expected_weights(), torch.bfloat16, DEV, seed=3)
    model.load_weights((name, isq_weight(name, w, qtype, DEV)) for name, w in weights)
    model.finish_loading()
    return model


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q4_0], ids=lambda t: t.name)
def test_model_logits_equal_with_and_without_fusion(qtype: QT, fusion: Callable[[bool], None]) -> None:
    """Eager forwards of a 7-token batch (Q4_0: one GEMV pass; Q4_K: the tensor-core product) and of 13 one-token
    sequences (two passes, or one tensor-core product)."""
    model = _tiny_llama(qtype)
    layers = len(model.model.layers)
    for query_lens in ([3, 4], [1] * 13):
        t = sum(query_lens)
        ids = torch.randint(0, VOCAB, (t,), generator=torch.Generator().manual_seed(t)).to(DEV)
        pos = torch.cat([torch.arange(q) for q in query_lens]).to(DEV)
        meta = AttentionMetadata.build(query_lens, device=DEV)
        logits = {}
        for on in (False, True):
            fusion(on)
            with counting(*QUANTIZER_CALLS, *CODE_CALLS) as counts, torch.inference_mode():
                logits[on] = model.compute_logits(model(ids, pos, meta))
            # every linear of the tiny model is narrow (out_features < MMQ_WIDE_FEATURES): one rule for all
            per_linear = launches(qtype, t, TINY_LLAMA["intermediate_size"], TINY_LLAMA["hidden_size"])
            fused = 3 * layers * per_linear if on else 0  # qkv, gate_up, down of each layer; o_proj quantizes itself
            assert sum(counts[c] for c in CODE_CALLS) == fused, (on, counts)
            assert sum(counts[c] for c in QUANTIZER_CALLS) == 4 * layers * per_linear - fused, (on, counts)
        assert torch.equal(logits[True], logits[False]), f"{query_lens}: logits differ with the fusion"


def test_engine_greedy_equal_with_and_without_fusion(tmp_path: Path, fusion: Callable[[bool], None]) -> None:
    """Through LLM.generate with --isq q4k and decode CUDA graphs captured under each setting: tokens and their
    logprobs (functions of the logits) equal."""
    model = str(write_tiny_model_dir(tmp_path, TINY_LLAMA, VOCAB))
    g = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(0, VOCAB, (int(n),), generator=g).tolist()} for n in (5, 17, 2, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {}
    for on in (True, False):
        fusion(on)
        llm = LLM(model=model, load_format="dummy", isq="q4k", dtype="bf16", mem=64, max_num_seqs=8, seed=0)
        assert llm.engine.runner.graphs is not None, "decode should run inside CUDA graphs"
        outs[on] = llm.generate(prompts, params)
        del llm
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        logprobs_a, logprobs_b = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert logprobs_a is not None and logprobs_b is not None
        for la, lb in zip(logprobs_a, logprobs_b, strict=True):
            assert {k: v.logprob for k, v in la.items()} == {k: v.logprob for k, v in lb.items()}
