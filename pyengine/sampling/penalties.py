"""Logit adjustments before temperature: allowed_token_ids, logit_bias, min_tokens, bad_words, the penalties.

Formulas (OpenAI / vLLM), for a row's logit ``l`` of token ``t``:
- allowed_token_ids: ``l = -inf`` for every token not in the row's list (its own values kept for the rest).
- logit_bias: ``l += bias[t]``.
- min_tokens: ``l = -inf`` for every stop token while the row has fewer than min_tokens output tokens.
- bad_words: ``l = -inf`` for a token that would complete one of the row's bad words (bad_words.py).
- repetition (HF/CTRL style, prompt and output tokens): ``l = l / r`` if ``l > 0`` else ``l * r``.
- frequency then presence (output tokens only, from the first generated token):
  ``l -= frequency * count[t]``; ``l -= presence * (count[t] > 0)``.
Each function edits ``logits`` (f32 [B, V]) in place.
"""

from __future__ import annotations

import torch

from candle_vllm.pyengine.sampling.batch import SamplingBatch


def apply_allowed_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Keep only each listed row's allowed tokens."""
    if batch.allowed is not None:
        rows, local, tokens = batch.allowed
        kept = torch.full((rows.numel(), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        kept[local, tokens] = logits[rows[local], tokens]
        logits[rows] = kept


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Add each row's requested biases."""
    if batch.logit_bias is not None:
        rows, tokens, biases = batch.logit_bias
        logits.index_put_((rows, tokens), biases, accumulate=True)


def apply_bans(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Forbid stop tokens on rows that have not yet produced min_tokens tokens, and bad words' last tokens."""
    if batch.banned is not None:
        rows, tokens = batch.banned
        logits[rows, tokens] = float("-inf")


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition, frequency and presence penalties on the rows that set any of them."""
    pen = batch.penalties
    if pen is None:
        return
    rows = logits[pen.rows]
    if pen.seen is not None:
        r = pen.repetition[:, None]
        scaled = torch.where(rows > 0, rows / r, rows * r)
        rows = torch.where(pen.seen, scaled, rows)
    rows -= pen.frequency[:, None] * pen.output_counts
    rows -= pen.presence[:, None] * (pen.output_counts > 0).float()
    logits[pen.rows] = rows
