"""Tiny random transformers models of each supported family, saved as HF checkpoints (test oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5,
)
LLAMA3_ROPE: dict[str, Any] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "llama3_rope": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "llama3_rope_d64": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE, "hidden_size": 256}),  # head_dim 64
    "linear_rope": (LlamaConfig, {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "yarn_rope": (LlamaConfig, {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}}),
    "mistral_sliding": (MistralConfig, {"sliding_window": 6}),
    "qwen2_bias": (Qwen2Config, {}),
    "qwen3_qk_norm": (Qwen3Config, {"head_dim": 32}),
    "llama_attention_bias": (LlamaConfig, {"attention_bias": True}),  # q/k/v and o_proj biased
    "qwen3_attention_bias": (Qwen3Config, {"head_dim": 32, "attention_bias": True}),
    "yi": (LlamaConfig, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6}, "num_key_value_heads": 1}),
    "smollm_tied": (LlamaConfig, {"tie_word_embeddings": True}),
}


def make_hf_model(case: str, seed: int = 0) -> PreTrainedModel:
    """A random fp32 model with every parameter (norms and biases too) drawn away from its default init,
    scaled so logits spread over several units and a wrong op shows."""
    cls, extra = CASES[case]
    config = cls(**{**BASE, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else p.shape[-1] ** -0.5))
    return model


def save_hf_model(model: PreTrainedModel, path: Path, sharded: bool = False) -> Path:
    kwargs: dict[str, Any] = {"max_shard_size": "60KB"} if sharded else {}
    model.save_pretrained(path, **kwargs)
    return path


@torch.inference_mode()
def hf_logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """Logits [L, V] of one sequence."""
    return model(ids.unsqueeze(0)).logits[0].float()
