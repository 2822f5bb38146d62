"""Model classes by HF ``architectures`` name (GGUF architectures map onto these in ``config``)."""

from __future__ import annotations

from candle_vllm.pyengine.config import ModelConfig
from candle_vllm.pyengine.models.base import CausalLM
from candle_vllm.pyengine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "YiForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Base models without their LM head, as embedding checkpoints are saved (Qwen3-Embedding, e5-mistral, gte):
    # their tensors carry no "model." prefix and the head is tied to the embedding (loader/load.py).
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The class implementing ``config.architecture``; a clear error for architectures not ported yet."""
    cls = MODEL_REGISTRY.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"architecture {config.architecture!r} is not supported (supported: {', '.join(sorted(MODEL_REGISTRY))})"
        )
    return cls
