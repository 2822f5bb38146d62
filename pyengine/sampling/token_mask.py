"""Per-row token masks for grammar-constrained rows (structured output), applied to the logits in place.

Grammar libraries hand out the allowed tokens of a row as a packed bitmask: int32 words, bit ``j`` of word
``w`` allowing token ``32 * w + j`` (llguidance's and xgrammar's layout). Only the constrained rows carry
one, so a batch without them pays nothing, and a batch with some touches only those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from candle_vllm.pyengine.ops.transfer import to_device


@dataclass(slots=True)
class TokenMask:
    """Allowed tokens of the constrained rows of one step.

    ``rows``: int64 [C], indices into the batch; ``bitmask``: int32 [C, W], one packed mask per listed row.
    Tokens past ``32 * W`` (a model vocabulary padded beyond the tokenizer's) are never allowed.
    """

    rows: torch.Tensor
    bitmask: torch.Tensor

    def to(self, device: torch.device | str) -> TokenMask:
        """On ``device``, without a host wait; the host buffers may be reused as soon as this returns."""
        device = torch.device(device)
        return TokenMask(to_device(self.rows, device), to_device(self.bitmask, device))


_BYTE_BIAS: dict[torch.device, torch.Tensor] = {}


def _byte_bias(device: torch.device) -> torch.Tensor:
    """f32 [256, 8]: entry (v, i) is 0 when bit i of byte v is set (token allowed), -inf otherwise."""
    table = _BYTE_BIAS.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _BYTE_BIAS[device] = torch.where(bits == 1, 0.0, float("-inf")).to(device)
    return table


def mask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """f32 [C, vocab_size]: 0 where the packed ``bitmask`` (int32 [C, W]) allows the token, -inf elsewhere.

    One table lookup per byte of the mask (little-endian words: byte k of word w holds tokens 32w+8k..+7),
    about 4x faster than shifting every bit out on CPU."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"a token bitmask is int32 [rows, words], got {bitmask.dtype} {tuple(bitmask.shape)}")
    bias = _byte_bias(bitmask.device)[bitmask.view(torch.uint8).long()].flatten(1)  # [C, 32 * W]
    if bias.shape[1] >= vocab_size:
        return bias[:, :vocab_size]
    return torch.nn.functional.pad(bias, (0, vocab_size - bias.shape[1]), value=float("-inf"))


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the logits of every token a row's grammar forbids to -inf (only the rows listed in ``mask``); the
    allowed ones keep their exact values (x + 0)."""
    if mask.rows.numel() == 0:
        return
    logits.index_add_(0, mask.rows, mask_bias(mask.bitmask, logits.shape[1]))
