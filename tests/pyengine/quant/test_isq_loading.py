"""``--isq`` through the loader: a tiny random transformers Llama saved as safetensors loads with its decoder
linears as GGUF blocks (embeddings and LM head dense), and its logits and greedy tokens stay close to the
unquantized model's; dummy weights, partial super-blocks and already-quantized GGUF files."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import LlamaConfig, LlamaForCausalLM

from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.llm import LLM
from candle_vllm.pyengine.loader import ModelLoadError, load_model, resolve_model_source
from candle_vllm.pyengine.models import llama
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.quant import GGUFLinear, UnquantizedLinear

CPU = torch.device("cpu")


def _save_llama(path: Path, hidden: int = 256, inter: int = 512) -> Path:
    """A random 2-layer Llama (GQA 4/2 heads), std 1/sqrt(fan_in) projections so logits spread over units."""
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=128, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
    model.save_pretrained(path)
    return path


def _load(path: Path, isq: str | None, load_format: str = "auto") -> llama.LlamaForCausalLM:
    src = resolve_model_source(str(path), load_format=load_format)
    loaded = load_model(src, torch.float32, CPU, load_format=load_format, isq=isq)
    return cast(llama.LlamaForCausalLM, loaded.model)


@torch.inference_mode()
def _logits(model: llama.LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(len(ids))
    return model.compute_logits(model(ids, pos, AttentionMetadata.build([len(ids)])))


@torch.inference_mode()
def _greedy(model: llama.LlamaForCausalLM, prompt: torch.Tensor, steps: int) -> list[int]:
    ids = prompt.clone()
    for _ in range(steps):
        ids = torch.cat([ids, _logits(model, ids)[-1].argmax().view(1)])
    return ids[len(prompt):].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def dense(checkpoint: Path) -> llama.LlamaForCausalLM:
    return _load(checkpoint, None)


# Measured on this model (logit std ~1): relative logit error ||l_isq - l|| / ||l|| 1.2% for Q8_0 and 11% for
# Q4_K (about 2.5x the weights' relative RMS quantization error, ~0.5% and ~5%, grown through 2 layers); the
# bounds are twice that. Teacher-forced top-1 agreement measured 98% / 80%; greedy runs agreed for 11 / 2 steps.
CASES = {"q8_0": (QT.Q8_0, 0.025, 0.95, 8), "q4k": (QT.Q4_K, 0.22, 0.7, 2)}


@pytest.mark.parametrize("name", list(CASES))
def test_safetensors_checkpoint_quantized_in_situ(
    name: str, checkpoint: Path, dense: llama.LlamaForCausalLM
) -> None:
    qtype, bound, top1, steps = CASES[name]
    model = _load(checkpoint, name)
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert len(lin.methods) == 1 and isinstance(lin.methods[0], GGUFLinear)
            assert lin.methods[0].qtype == qtype
    assert isinstance(model.lm_head.methods[0], UnquantizedLinear)
    assert isinstance(model.model.embed_tokens.method, UnquantizedLinear)
    ids = torch.randint(0, 320, (64,), generator=torch.Generator().manual_seed(2))
    want, got = _logits(dense, ids), _logits(model, ids)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= bound, f"relative logit error {rel:.4f} > {bound}"
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= top1, f"top-1 agreement {agree:.3f} < {top1}"
    assert _greedy(model, ids[:8], steps) == _greedy(dense, ids[:8], steps)


def test_dummy_weights_and_partial_super_blocks_fall_back(tmp_path: Path) -> None:
    """hidden 96 is whole 32-blocks but not 256-blocks: q4k rows over it become Q5_0 (llama.cpp's choice);
    the intermediate 512 rows of down_proj stay Q4_K."""
    path = _save_llama(tmp_path, hidden=96, inter=512)
    (path / "model.safetensors").unlink()
    model = _load(path, "q4k", load_format="dummy")
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.methods[0].qtype == QT.Q5_0
    assert layer.mlp.down_proj.methods[0].qtype == QT.Q4_K
    logits = _logits(model, torch.arange(10))
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_quantized_gguf_with_isq_is_refused() -> None:
    """Through the engine (so --isq reaches the loader): requantizing Q4_1 blocks would compound two roundings."""
    with pytest.raises(ModelLoadError, match=r"--isq q4k: .*already quantized \(Q4_1\).*drop --isq"):
        LLM(isq="q4k")


def test_engine_args_accept_isq() -> None:
    assert EngineArgs(isq="q4k").isq == "q4k"
