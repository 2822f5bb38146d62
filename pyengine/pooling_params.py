"""vLLM's ``PoolingParams`` (``from candle_vllm import PoolingParams``): what ``LLM.embed`` does to a prompt's
vector, so code that passes one to vLLM's ``LLM.embed`` runs unchanged."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """``dimensions`` keeps the first d components of the vector and normalises them again, for models trained
    for it (Matryoshka; others refuse it, as in vLLM). vLLM's other fields are not built: ``normalize=False``
    (vectors are always L2-normalised) and ``truncate_prompt_tokens`` are refused, not ignored."""

    dimensions: int | None = None
    normalize: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if not self.normalize:
            raise ValueError("normalize=False is not supported: the vectors are always L2-normalised")
        if self.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens is not supported; shorten the prompt")
