"""What the engine needs of a model family (the runner, the CUDA graphs and the loader call nothing else), as a
base class: a family states these methods once, and the type checker sees every call the engine makes on a model,
including those only the GPU runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.quant import WeightData


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over a flat token batch and a paged KV cache (one tensor per layer in ``kv_caches``)."""

    supports_output_rows = False  # forward takes output_rows (the runner may ask for the sampled rows only)
    kv_caches: list[torch.Tensor]  # bound by the engine before the first step

    @staticmethod
    @abstractmethod
    def hf_name_from_gguf(name: str) -> str | None:
        """The HF name of a llama.cpp tensor name, or None for a tensor the model does not use."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [T] at absolute positions [T] -> final-normed hidden states [T, H] (or the ``output_rows``)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, *, f32: bool = True) -> torch.Tensor:
        """Hidden states [N, H] -> logits [N, V], f32 or in the LM head's dtype."""

    @abstractmethod
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every checkpoint tensor the model needs."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, WeightData]]) -> set[str]:
        """Load HF-named tensors (any subset, any order); returns the names used."""

    def finish_loading(self) -> None:
        """Called once every weight is in (tie weights, fold or repack them)."""

    def tie_lm_head(self) -> None:
        """Use the token embedding as the LM head: for checkpoints that ship none (base models saved for their
        embeddings, which then serve embeddings only). Models that cannot tie keep the default, which refuses."""
        raise ValueError(f"{type(self).__name__} cannot tie its LM head to the embedding")
