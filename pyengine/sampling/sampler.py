"""The batched sampler: one call per step turns logits [B, V] into a token per row (plus logprobs).

Order, as vLLM: the grammar mask of structured-output rows (before the raw logprobs, as vLLM applies its
bitmask to the model's logits), allowed_token_ids (after them, as in vLLM v1), logit_bias, min_tokens, penalties;
greedy rows take the argmax there; the others divide by their temperature, apply top-k, top-p, min-p, and draw. Drawing is an exponential race: the token is
``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. per token, which picks token ``t`` with probability ``p_t``.
A seeded row takes its ``q`` from its own generator, exactly ``V`` values per step, so its tokens depend only
on its seed and its own logits, never on which other rows share the step or where it sits in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from candle_vllm.pyengine.ops import cuda
from candle_vllm.pyengine.sampling.batch import SamplingBatch
from candle_vllm.pyengine.sampling.filters import apply_min_p, apply_top_k_top_p
from candle_vllm.pyengine.sampling.logprobs import LogprobsTensors, compute_logprobs
from candle_vllm.pyengine.sampling.penalties import (
    apply_allowed_tokens,
    apply_bans,
    apply_logit_bias,
    apply_penalties,
)
from candle_vllm.pyengine.sampling.token_mask import apply_token_mask


@dataclass(slots=True)
class SamplerOutput:
    """The step's chosen tokens and, when any row asked, their raw logprobs (``max_num_logprobs`` wide)."""

    sampled_token_ids: torch.Tensor  # int64 [B]
    logprobs: LogprobsTensors | None


class Sampler:
    """Samples every row of a step with that row's own parameters, on the logits' device (CPU or CUDA).

    ``generator`` is the stream shared by unseeded rows (torch's default stream when None); it must live on
    the device of the logits.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows or logits.shape[1] != batch.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match the batch "
                f"({batch.num_rows} rows, vocab {batch.vocab_size})"
            )
        if self._argmax_only(batch):
            # argmax is the same over the LM head's bf16/f16 values as over their exact f32 copy: skip the copy
            return SamplerOutput(sampled_token_ids=greedy_argmax(logits), logprobs=None)
        raw = logits.float()
        if batch.token_mask is not None:
            if raw is logits:  # never write into the caller's tensor
                raw = raw.clone()
            apply_token_mask(raw, batch.token_mask)
        processed = self.process_logits(raw, batch)
        token_ids = self._choose(processed, batch)
        logprobs = None
        if batch.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw, token_ids, batch.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _argmax_only(batch: SamplingBatch) -> bool:
        """Every row greedy, and nothing (grammar mask, allowed tokens, bias, min_tokens, penalties, logprobs) reads
        the logits."""
        return (batch.all_greedy and batch.token_mask is None and batch.max_num_logprobs is None
                and not _has_processors(batch))

    @staticmethod
    def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``logits`` with allowed_token_ids, logit_bias, min_tokens and penalties applied, in a copy; greedy rows
        argmax it.
        A batch with none of them gets ``logits`` itself back (no [B, V] copy): treat the result as read-only."""
        if not _has_processors(batch):
            return logits
        out = logits.clone()
        apply_allowed_tokens(out, batch)
        apply_logit_bias(out, batch)
        apply_bans(out, batch)
        apply_penalties(out, batch)
        return out

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_ids = greedy_argmax(logits) if batch.any_greedy else None
        if greedy_ids is not None and batch.all_greedy:
            return greedy_ids
        assert batch.temperature is not None
        logits = logits / batch.temperature[:, None]  # a new tensor: the caller's may be the raw logits
        # vLLM v1's order: min-p (invariant to the argmax) first, then top-k and top-p over what it kept, so a
        # top-p mass is measured after min-p's cut.
        if batch.min_p is not None:
            apply_min_p(logits, batch.min_p)
        logits = apply_top_k_top_p(
            logits, batch.top_k, batch.max_top_k, batch.top_p, batch.top_k_on_every_row
        )
        probs = logits.softmax(dim=-1)
        random_ids = probs.div_(self._exponential_noise(probs, batch)).argmax(dim=-1)
        if greedy_ids is None:
            return random_ids
        assert batch.greedy is not None
        return torch.where(batch.greedy, greedy_ids, random_ids)

    def _exponential_noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if batch.any_unseeded_random:
            noise.exponential_(generator=self.generator)
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        # A draw of exactly 0 would turn p / q into inf or nan and could pick a masked token.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _has_processors(batch: SamplingBatch) -> bool:
    """Whether any row's logits are changed before choosing: allowed_token_ids, logit_bias, min_tokens, penalties."""
    return (batch.allowed is not None or batch.logit_bias is not None or batch.banned is not None
            or batch.penalties is not None)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``; on CUDA the native kernel, which spreads a row over many CTAs (a batch-1 step's
    argmax over 128k logits is on the decode critical path: 26.5 us for torch's kernel on the H200)."""
    if logits.device.type == "cuda" and cuda.available(logits.device):
        return cuda.argmax(logits)
    return logits.argmax(dim=-1)
