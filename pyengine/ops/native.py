"""Thin bridge to ``candle_vllm._native``.

The native module does not link libtorch (DESIGN.md, native module contract): tensors cross as data pointers
plus sizes. This module owns the checks that make that safe (device, dtype, contiguity) and the switch that
forces the torch references (``CANDLE_VLLM_OPS=reference``), so every op wrapper stays a few lines.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

# Must match native/bindings/tensor_arg.h::DType.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.uint8: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.float8_e4m3fn: 6,
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def module() -> ModuleType | None:
    """The compiled extension, or None when the package was installed without it."""
    try:
        _native = importlib.import_module("candle_vllm._native")
    except ImportError:
        return None
    return _native


def loaded() -> ModuleType:
    """The compiled extension, for callers that checked :func:`available` (or a kernel's ``supported``) first."""
    mod = module()
    if mod is None:
        raise RuntimeError("candle_vllm._native is not built; reinstall candle-vllm with its native module")
    return mod


def reference_forced() -> bool:
    """True when ``CANDLE_VLLM_OPS=reference`` asks every op to use its torch reference."""
    return os.environ.get("CANDLE_VLLM_OPS", "").strip().lower() == "reference"


def available(device: torch.device) -> bool:
    """Whether native kernels may run for tensors on ``device``."""
    mod = module()
    if mod is None or reference_forced():
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and bool(mod.built_with_cuda)


def ptr(t: torch.Tensor) -> int:
    """Address of a contiguous tensor's first element (the caller checked contiguity)."""
    return t.data_ptr()


def dtype_code(t: torch.Tensor) -> int:
    return DTYPE_CODES[t.dtype]


def ready(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> bool:
    """True when all tensors share one device with native kernels, are contiguous and have an allowed dtype."""
    device = tensors[0].device
    if not available(device):
        return False
    return all(t.device == device and t.is_contiguous() and t.dtype in dtypes for t in tensors)


def stream(device: torch.device) -> int:
    """The caller's current CUDA stream handle, so kernels launch on it (and CUDA-graph capture sees them)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
