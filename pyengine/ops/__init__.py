"""Hot ops: each has a torch reference (runs anywhere) and native kernels picked when device, dtype and shape
allow. ``CANDLE_VLLM_OPS=reference`` forces the references; tests compare both paths."""

from candle_vllm.pyengine.ops.norm import fused_add_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "rms_norm"]
