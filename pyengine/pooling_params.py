"""vLLM's ``PoolingParams`` (``from candle_vllm import PoolingParams``): what ``LLM.embed`` does to a prompt's
vector, so code that passes one to vLLM's ``LLM.embed`` runs unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from candle_vllm.pyengine.sampling.params import truncation_ok


@dataclass(frozen=True)
class PoolingParams:
    """``dimensions`` keeps the first d components of the vector and normalises them again, for models trained
    for it (Matryoshka; others refuse it, as in vLLM); ``truncate_prompt_tokens`` embeds the prompt's last k tokens
    (-1: as many as the model takes). ``normalize=False`` is not built (vectors are always L2-normalised): refused,
    not ignored."""

    dimensions: int | None = None
    normalize: bool | None = True  # None: vLLM's default, True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is False:
            raise ValueError("normalize=False is not supported: the vectors are always L2-normalised")
        if not truncation_ok(self.truncate_prompt_tokens):
            raise ValueError("truncate_prompt_tokens must be -1 (as many tokens as the model takes) or at least 1, "
                             f"got {self.truncate_prompt_tokens!r}")


def embedding_keep(keep: int | None, max_model_len: int) -> int | None:
    """``truncate_prompt_tokens`` for an embedding request: vLLM's values (-1, or up to the context) keep at most
    the context less one token, whose place the engine's internal token takes; other values pass on unchanged, to
    be refused with vLLM's message."""
    if keep is None or not truncation_ok(keep) or keep > max_model_len:
        return keep
    return max_model_len - 1 if keep == -1 else min(keep, max_model_len - 1)
