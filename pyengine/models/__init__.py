"""Model families (one module each) and the registry that picks one for a config."""

from candle_vllm.pyengine.models.llama import LlamaForCausalLM
from candle_vllm.pyengine.models.registry import MODEL_REGISTRY, model_class

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "model_class"]
