"""Linear methods: how a linear layer stores its weight and computes ``x @ W.T`` for each weight format."""

from candle_vllm.pyengine.quant.base import LinearMethod, WeightData, build_linear_methods
from candle_vllm.pyengine.quant.gguf import GGUFLinear, GGUFWeight
from candle_vllm.pyengine.quant.unquantized import UnquantizedLinear

__all__ = ["GGUFLinear", "GGUFWeight", "LinearMethod", "UnquantizedLinear", "WeightData", "build_linear_methods"]
