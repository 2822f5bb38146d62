"""Truncation of each row's distribution after temperature: top-k, then top-p, then min-p.

Masked tokens get ``-inf`` logits. Rows whose setting is disabled (top_k 0, top_p 1, min_p 0) are left
untouched, apart from tokens whose probability already rounds to zero.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties with the k-th kept), then its smallest set of most
    likely tokens whose probability sums to at least ``top_p`` (at least one token always survives).

    ``top_k``: int64 [B], 0 = disabled, ``max_top_k`` its largest value; ``top_p``: f32 [B]. Returns the
    masked logits (may be a new tensor).
    """
    if top_p is None:
        if top_k is not None:
            kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
            kth.masked_fill_(top_k[:, None] == 0, _NEG_INF)
            logits.masked_fill_(logits < kth, _NEG_INF)
        return logits
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        # top_k 0 points at column 0, the row's minimum, which masks nothing.
        kth = ascending.gather(1, (logits.shape[-1] - top_k).remainder(logits.shape[-1])[:, None])
        ascending.masked_fill_(ascending < kth, _NEG_INF)
    # Mass of each token and all less likely ones; drop tokens whose such mass stays within 1 - top_p.
    tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    dropped = tail_mass <= (1.0 - top_p)[:, None]
    dropped[:, -1] = False
    ascending.masked_fill_(dropped, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, ascending)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token (in place, returned)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, _NEG_INF)
