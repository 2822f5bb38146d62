"""Model building blocks shared by the model families: linear, embedding, norm, rotary, attention."""

from candle_vllm.pyengine.layers.attention import Attention
from candle_vllm.pyengine.layers.embedding import VocabEmbedding
from candle_vllm.pyengine.layers.linear import Linear
from candle_vllm.pyengine.layers.norm import RMSNorm
from candle_vllm.pyengine.layers.rotary import RotaryEmbedding

__all__ = ["Attention", "Linear", "RMSNorm", "RotaryEmbedding", "VocabEmbedding"]
