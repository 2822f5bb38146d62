"""Helpers shared by the CUDA kernel tests: relative-error checks and allocator poisoning."""

from __future__ import annotations

import torch

# ||out - ref|| / ||ref|| bounds per storage dtype (outputs rounded once to that dtype, f32 accumulation).
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()  # references may be computed on the host
    assert torch.isfinite(got).all(), "output holds NaN/inf (unwritten or overflowed elements)"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def poison_allocator(device: torch.device, numel: int) -> None:
    """Fill and free a block of NaNs, so the next allocations of the caching allocator start as NaN and an
    element a kernel forgets to write shows up as NaN instead of a plausible stale value."""
    junk = torch.full((numel,), float("nan"), dtype=torch.float32, device=device)
    del junk
