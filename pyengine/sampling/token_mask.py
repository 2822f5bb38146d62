"""Per-row token masks for grammar-constrained rows (structured output), applied to the logits in place.

Grammar libraries hand out the allowed tokens of a row as a packed bitmask: int32 words, bit ``j`` of word
``w`` allowing token ``32 * w + j`` (llguidance's and xgrammar's layout). Only the constrained rows carry
one, so a batch without them pays nothing, and a batch with some touches only those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS_PER_WORD = 32


@dataclass(slots=True)
class TokenMask:
    """Allowed tokens of the constrained rows of one step.

    ``rows``: int64 [C], indices into the batch; ``bitmask``: int32 [C, W], one packed mask per listed row.
    Tokens past ``32 * W`` (a model vocabulary padded beyond the tokenizer's) are never allowed.
    """

    rows: torch.Tensor
    bitmask: torch.Tensor

    def to(self, device: torch.device | str) -> TokenMask:
        return TokenMask(self.rows.to(device, non_blocking=True), self.bitmask.to(device, non_blocking=True))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [C, vocab_size]: True where the packed ``bitmask`` (int32 [C, W]) allows the token."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"a token bitmask is int32 [rows, words], got {bitmask.dtype} {tuple(bitmask.shape)}")
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [C, 32 * W]
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the logits of every token a row's grammar forbids to -inf (only the rows listed in ``mask``)."""
    if mask.rows.numel() == 0:
        return
    allowed = unpack_bitmask(mask.bitmask, logits.shape[1])
    constrained = logits.index_select(0, mask.rows)
    constrained.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, mask.rows, constrained)
