"""Hot ops: each has a torch reference (runs anywhere) and native kernels picked when device, dtype and shape
allow. ``CANDLE_VLLM_OPS=reference`` forces the references; tests compare both paths."""

from candle_vllm.pyengine.ops.activation import silu_and_mul
from candle_vllm.pyengine.ops.attention import AttentionMetadata, attention, write_kv
from candle_vllm.pyengine.ops.norm import fused_add_rms_norm, rms_norm
from candle_vllm.pyengine.ops.quant import dequantize, quant_matmul
from candle_vllm.pyengine.ops.rotary import apply_rotary, rope_cos_sin_cache, rope_inv_freq

__all__ = [
    "AttentionMetadata",
    "apply_rotary",
    "attention",
    "dequantize",
    "fused_add_rms_norm",
    "quant_matmul",
    "rms_norm",
    "rope_cos_sin_cache",
    "rope_inv_freq",
    "silu_and_mul",
    "write_kv",
]
