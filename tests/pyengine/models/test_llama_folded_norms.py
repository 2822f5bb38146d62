"""Norm weights folded into qkv_proj / gate_up_proj (``LlamaForCausalLM.fold_norms``): steps of 17..256 tokens then
run the layers with each RMSNorm deferred past its linear (``forward_folded``), the others with unit-weight norms.
Both must still give transformers' logits: fp32 on the CPU (torch fallbacks, 1e-4), bf16 on the GPU (the RoPE + cache
and SiLU kernels apply the deferred scale; no worse against transformers than the same model left unfolded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from tiny_models import hf_logits, make_hf_model, save_hf_model

from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.loader import load_model, resolve_model_source
from candle_vllm.pyengine.models import llama
from candle_vllm.pyengine.models.llama import LlamaForCausalLM
from candle_vllm.pyengine.ops import cuda, cuda_rotary, cuda_turbo
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.quant import UnquantizedLinear

TOL = 1e-4
BLOCK_SIZE, NUM_BLOCKS = 4, 24
# Two sequences of 40 and 36 tokens: steps of 37 and 35 tokens (deferred norms) between 2-token decode steps.
SCHEDULES = [[20, 1, 18, 1], [17, 1, 17, 1]]


def _load(path: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    loaded = load_model(resolve_model_source(str(path)), dtype, torch.device(device))
    return cast(LlamaForCausalLM, loaded.model)


def _run_schedule(model: LlamaForCausalLM, seqs: list[torch.Tensor], device: torch.device,
                  turbo_mode: str | None = None) -> list[torch.Tensor]:
    """Logits of every token of both sequences, advanced together through a paged cache by ``SCHEDULES`` (dense
    caches of random values, or zeroed TurboQuant rows of ``turbo_mode``)."""
    cfg = model.config
    g = torch.Generator().manual_seed(8)
    dtype = model.model.norm.weight.dtype
    row = TurboFormat(turbo_mode, cfg.head_dim).row_bytes if turbo_mode else 0
    model.kv_caches = [
        torch.zeros(1, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, row, dtype=torch.uint8, device=device) if turbo_mode
        else torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, generator=g).to(device, dtype)
        for _ in range(cfg.num_layers)
    ]
    tables = [list(range(0, 10)), list(range(10, 19))]
    done = [0, 0]
    got: list[list[torch.Tensor]] = [[], []]
    for step in range(len(SCHEDULES[0])):
        qlens = [SCHEDULES[i][step] for i in range(2)]
        meta = AttentionMetadata.build(
            qlens, [done[i] + q for i, q in enumerate(qlens)], str(device), tables, BLOCK_SIZE
        )
        ids = torch.cat([seqs[i][done[i] : done[i] + q] for i, q in enumerate(qlens)]).to(device)
        pos = torch.cat([torch.arange(done[i], done[i] + q) for i, q in enumerate(qlens)]).to(device)
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos, meta)).cpu()
        for i, part in enumerate(logits.split(qlens)):
            got[i].append(part)
            done[i] += qlens[i]
    return [torch.cat(parts) for parts in got]


def _norm_calls(model: LlamaForCausalLM) -> list[int]:
    """Token counts of every call of a decoder layer's norm (the final norm not counted)."""
    calls: list[int] = []
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    return calls


def _sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (sum(s),), generator=g) for s in SCHEDULES]


@pytest.mark.parametrize("case", ["llama3_rope", "mistral_sliding", "smollm_tied"])
def test_folded_norms_match_transformers_on_cpu(case: str, tmp_path: Path) -> None:
    hf = make_hf_model(case, seed=4)
    model = _load(save_hf_model(hf, tmp_path), torch.float32, torch.device("cpu"))
    assert not model.norms_folded, "the CPU path keeps its norms unless asked"
    qkv_before = cast(UnquantizedLinear, model.model.layers[0].self_attn.qkv_proj.methods[0]).weight.clone()
    assert model.fold_norms()
    layer = model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    assert not torch.allclose(cast(UnquantizedLinear, layer.self_attn.qkv_proj.methods[0]).weight, qkv_before)
    calls = _norm_calls(model)
    seqs = _sequences()
    got = _run_schedule(model, seqs, torch.device("cpu"))
    layers = model.config.num_layers
    assert calls == [2] * (2 * layers) * 2, f"norms ran in the deferred steps, or not in the 2-token ones: {calls}"
    for i, seq in enumerate(seqs):
        assert (got[i] - hf_logits(hf, seq)).abs().max().item() <= TOL


@pytest.mark.parametrize("case,dtype", [("qwen3_qk_norm", torch.float32), ("qwen2_bias", torch.float32),
                                        ("llama", torch.float16)])
def test_fold_refused_where_it_would_not_hold(case: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """q/k norms and a qkv bias would need the deferred scale before them, and f16 could overflow on the unscaled
    projections: those models keep their norms."""
    model = _load(save_hf_model(make_hf_model(case), tmp_path), dtype, torch.device("cpu"))
    weight = model.model.layers[0].input_layernorm.weight.clone()
    assert not model.fold_norms()
    assert not model.norms_folded
    assert torch.equal(model.model.layers[0].input_layernorm.weight, weight)


def test_output_rows_with_folded_norms(tmp_path: Path) -> None:
    """``output_rows`` in a deferred prefill through the paged cache (as the runner's chunked prefill asks): the
    last layer's o_proj and MLP add into the chosen rows only, and every token's K/V reach the cache (the decode
    step after it is checked too)."""
    hf = make_hf_model("llama3_rope", seed=5)
    model = _load(save_hf_model(hf, tmp_path), torch.float32, torch.device("cpu"))
    assert model.fold_norms()
    cfg = model.config
    g = torch.Generator().manual_seed(6)
    model.kv_caches = [
        torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, generator=g) for _ in range(cfg.num_layers)
    ]
    seq = torch.randint(0, 256, (22,), generator=g)
    want = hf_logits(hf, seq)
    tables = [list(range(6))]
    rows = torch.tensor([20, 4, 9])
    with torch.inference_mode():
        meta = AttentionMetadata.build([21], [21], "cpu", tables, BLOCK_SIZE)
        got = model.compute_logits(model(seq[:21], torch.arange(21), meta, output_rows=rows))
        assert (got - want[rows]).abs().max().item() <= TOL
        meta = AttentionMetadata.build([1], [22], "cpu", tables, BLOCK_SIZE)
        got = model.compute_logits(model(seq[21:], torch.tensor([21]), meta))
    assert (got - want[21:]).abs().max().item() <= TOL


def test_turbo_caches_keep_the_norms(tmp_path: Path) -> None:
    """On the CPU no RoPE + cache kernel writes TurboQuant caches (on CUDA ``cuda_turbo.rope_cache_write_`` does),
    so with one the deferred steps run the (unit-weight) norms: the same logits as the model left unfolded, norms
    counted."""
    hf = make_hf_model("llama3_rope", seed=5)
    path = save_hf_model(hf, tmp_path)
    folded, plain = (_load(path, torch.float32, torch.device("cpu")) for _ in range(2))
    assert folded.fold_norms()
    cfg = folded.config
    fmt = TurboFormat("turbo8", cfg.head_dim)
    seq = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(6))
    meta = AttentionMetadata.build([20], [20], "cpu", [list(range(5))], BLOCK_SIZE)
    got = []
    for model in (folded, plain):
        model.kv_caches = [torch.zeros(1, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, fmt.row_bytes, dtype=torch.uint8)
                           for _ in range(cfg.num_layers)]
        calls = _norm_calls(model)
        with torch.inference_mode():
            got.append(model.compute_logits(model(seq, torch.arange(20), meta)))
        assert calls == [20] * (2 * cfg.num_layers)
    assert (got[0] - got[1]).abs().max().item() <= TOL


@pytest.mark.cuda
@pytest.mark.parametrize("turbo_mode", [None, "turbo8", "turbo4"])
def test_folded_norms_on_the_gpu_are_as_close_to_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, turbo_mode: str | None,
) -> None:
    """bf16 on CUDA: loading folds the norms; the deferred steps use the RoPE + cache kernel with the norm (for
    TurboQuant caches the one that writes rows), and the logits are as close to transformers' (fp32) as those of
    the same model with its norms kept (TurboQuant: head_dim 64, the rows' kernels' smallest)."""
    hf = make_hf_model("llama3_rope_d64" if turbo_mode else "llama3_rope", seed=7)
    path = save_hf_model(hf, tmp_path)
    seqs = _sequences()
    want = [hf_logits(hf, s) for s in seqs]
    folded = _load(path, torch.bfloat16, torch.device("cuda"))
    assert folded.norms_folded
    rope_norms: list[bool] = []
    silu_norms: list[bool] = []
    rope, turbo_rope, silu = cuda_rotary.rotary_embedding_cache_, cuda_turbo.rope_cache_write_, \
        cuda.silu_and_mul_interleaved

    def counting_rope(*args: Any, **kwargs: Any) -> None:
        rope_norms.append(len(args) > 9 and args[9] is not None)
        rope(*args, **kwargs)

    def counting_turbo_rope(*args: Any, **kwargs: Any) -> None:
        rope_norms.append(len(args) > 10 and args[10] is not None)
        turbo_rope(*args, **kwargs)

    def counting_silu(x: torch.Tensor, norm: DeferredRMSNorm | None = None) -> torch.Tensor | None:
        out = silu(x, norm)
        silu_norms.append(norm is not None and out is not None)
        return out

    monkeypatch.setattr(cuda_rotary, "rotary_embedding_cache_", counting_rope)
    monkeypatch.setattr(cuda_turbo, "rope_cache_write_", counting_turbo_rope)
    monkeypatch.setattr(cuda, "silu_and_mul_interleaved", counting_silu)
    got = _run_schedule(folded, seqs, torch.device("cuda"), turbo_mode)
    layers = folded.config.num_layers
    assert sum(rope_norms) == 2 * layers, "the deferred steps did not take the RoPE + cache kernel with the norm"
    assert sum(silu_norms) == 2 * layers, "the deferred steps did not take the SiLU kernel with the norm"
    monkeypatch.setenv(llama.FOLD_NORMS_ENV, "0")
    kept_model = _load(path, torch.bfloat16, torch.device("cuda"))
    assert not kept_model.norms_folded
    kept = _run_schedule(kept_model, seqs, torch.device("cuda"), turbo_mode)

    def err(a: list[torch.Tensor]) -> float:
        return max(((x - w).norm() / w.norm()).item() for x, w in zip(a, want, strict=True))

    assert err(got) <= 1.5 * err(kept) + 1e-3, (err(got), err(kept))
    assert err(got) < (3e-2 if turbo_mode is None else 0.5), (err(got), err(kept))
