"""Truncation of each row's distribution after temperature: top-k, then top-p, then min-p.

Masked tokens get ``-inf`` logits. Rows whose setting is disabled (top_k 0, top_p 1, min_p 0) are left
untouched, apart from tokens whose probability already rounds to zero. Top-k keeps exactly k tokens (among
logits tied with the k-th, which ones survive is unspecified).
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
    top_k_on_every_row: bool,
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits, then its smallest set of most likely tokens whose
    probability sums to at least ``top_p`` (at least one token always survives).

    ``top_k``: int64 [B], 0 = disabled, ``max_top_k`` its largest value; ``top_p``: f32 [B], 1 = disabled.
    When every row has a top-k (``top_k_on_every_row``) only the ``max_top_k`` best logits per row are
    sorted instead of the whole vocabulary. Returns the masked logits (may be a new tensor).
    """
    if top_k is None and top_p is None:
        return logits
    if top_k is not None and top_k_on_every_row:
        candidates, order = logits.topk(max_top_k, dim=-1)  # descending
        candidates.masked_fill_(torch.arange(max_top_k, device=logits.device) >= top_k[:, None], _NEG_INF)
        if top_p is not None:
            candidates = _top_p_on_sorted(candidates.flip(-1), top_p).flip(-1)
        return torch.full_like(logits, _NEG_INF).scatter_(-1, order, candidates)
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        vocab = logits.shape[-1]
        first_kept = torch.where(top_k > 0, vocab - top_k, 0)
        ascending.masked_fill_(torch.arange(vocab, device=logits.device) < first_kept[:, None], _NEG_INF)
    if top_p is not None:
        ascending = _top_p_on_sorted(ascending, top_p)
    return torch.empty_like(logits).scatter_(-1, order, ascending)


def _top_p_on_sorted(ascending: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p on logits sorted ascending per row: drop each token whose mass, together with all less likely
    tokens, stays within ``1 - top_p`` (summing from the small end keeps the tiny masses exact)."""
    tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    dropped = tail_mass <= (1.0 - top_p)[:, None]
    dropped[:, -1] = False
    return ascending.masked_fill_(dropped, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token (in place, returned)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, _NEG_INF)
