"""Random weights for benchmarking real architectures without downloading them (``--load-format dummy``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


def dummy_weights(
    shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Reproducible random tensors made directly on ``device`` (no host round trip for multi-GB models).

    Matrices get std 1/sqrt(fan_in) so every projection keeps activations near unit scale; norm weights
    are 1 and biases small, so logits stay finite and sampling behaves like a real model's.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype, device=device)
        elif len(shape) == 1:
            t = torch.randn(shape, generator=gen, dtype=dtype, device=device) * 0.02
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen, dtype=dtype, device=device)
        else:
            t = torch.randn(shape, generator=gen, dtype=dtype, device=device) * shape[-1] ** -0.5
        yield name, t
