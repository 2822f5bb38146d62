"""Host <-> device copies that never make the host wait for the device.

A plain ``tensor.to("cuda")`` from pageable memory (and ``.cpu()`` of a device tensor) synchronizes with the
stream, so the host would wait for every kernel queued before it, including the previous step still running:
the step pipeline (``runner.launch``) must never do that. These copies go through pinned memory instead, which
torch's caching host allocator keeps alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host, free to change afterwards) on ``device``, queued without a host wait."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor the device fills once the queued work before it has run (a CPU tensor is returned
    as it is); read it only after an event recorded after this call has completed."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
