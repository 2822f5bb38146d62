"""top-k / top-p / min-p masks against a per-row numpy reference walking tokens from most likely down."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from candle_vllm.pyengine.sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow
from candle_vllm.pyengine.sampling.filters import apply_min_p, apply_top_k_top_p

V = 64


def kept_reference(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens that survive, in float64, in vLLM v1's order: those with probability >= min_p * the best one's,
    then the k best of them (ties with the k-th kept), then the shortest most-likely prefix reaching mass top_p
    of what is left."""
    order = sorted(range(len(logits)), key=lambda t: -logits[t])
    if min_p > 0:
        weights = np.exp(logits[order] - logits[order[0]])
        order = [t for t, weight in zip(order, weights, strict=True) if weight >= min_p]
    if 0 < top_k < len(order):
        kth = logits[order[top_k - 1]]
        order = [t for t in order if logits[t] >= kth]
    weights = np.exp(logits[order] - logits[order[0]])
    probs = weights / weights.sum()
    kept, mass = [], 0.0
    for token, prob in zip(order, probs, strict=True):
        if mass >= top_p:
            break
        kept.append(token)
        mass += prob
    return set(kept)


ROW_SETTINGS = [  # (top_k, top_p, min_p)
    (0, 1.0, 0.0),
    (1, 1.0, 0.0),
    (5, 1.0, 0.0),
    (V + 10, 1.0, 0.0),
    (0, 0.5, 0.0),
    (0, 0.95, 0.0),
    (8, 0.7, 0.0),
    (0, 1.0, 0.1),
    (0, 1.0, 0.5),
    (10, 0.9, 0.05),
    (3, 0.2, 0.9),
    (0, 1e-4, 0.0),
]


def random_logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 2.5


def kept_tokens(masked: torch.Tensor) -> set[int]:
    return set(torch.isfinite(masked).nonzero().flatten().tolist())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masks_match_reference(seed: int) -> None:
    """Rows with and without top-k: the full-sort path."""
    logits = random_logits(len(ROW_SETTINGS), seed)
    top_k = torch.tensor([0 if k >= V else k for k, _, _ in ROW_SETTINGS])
    top_p = torch.tensor([p for _, p, _ in ROW_SETTINGS])
    min_p = torch.tensor([m for _, _, m in ROW_SETTINGS])
    masked = apply_top_k_top_p(apply_min_p(logits.clone(), min_p), top_k, int(top_k.max()), top_p, False)
    for i, (k, p, m) in enumerate(ROW_SETTINGS):
        kept = kept_tokens(masked[i])
        assert kept == kept_reference(logits[i].double().numpy(), k, p, m), (k, p, m)
        keep_idx = sorted(kept)
        assert torch.equal(masked[i, keep_idx], logits[i, keep_idx])


@pytest.mark.parametrize("with_top_p", [False, True])
def test_top_k_on_every_row_path_matches_reference(with_top_p: bool) -> None:
    """Every row has a top-k: only the best max_top_k logits per row are sorted."""
    ks = [1, 2, 7, V - 1, 30, 12]
    ps = [1.0, 0.5, 0.9, 0.95, 1e-4, 0.999] if with_top_p else [1.0] * len(ks)
    logits = random_logits(len(ks), 3)
    top_p = torch.tensor(ps) if with_top_p else None
    masked = apply_top_k_top_p(logits.clone(), torch.tensor(ks), max(ks), top_p, True)
    for i, (k, p) in enumerate(zip(ks, ps, strict=True)):
        assert kept_tokens(masked[i]) == kept_reference(logits[i].double().numpy(), k, p, 0.0), (k, p)


@pytest.mark.parametrize("every_row", [False, True])
def test_top_k_keeps_exactly_k_among_ties(every_row: bool) -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0]])
    masked = apply_top_k_top_p(logits.clone(), torch.tensor([2]), 2, torch.tensor([1.0]), every_row)
    kept = kept_tokens(masked[0])
    assert len(kept) == 2 and kept <= {1, 2, 4}


def test_samples_stay_inside_reference_set() -> None:
    """End to end through the sampler (temperature scaling first): every draw is a kept token."""
    temperature = 0.7
    base = random_logits(len(ROW_SETTINGS), 4)
    rows = [
        SamplingRow(SamplingParams(temperature=temperature, top_k=k, top_p=p, min_p=m), [])
        for k, p, m in ROW_SETTINGS
    ]
    batch = SamplingBatch.build(rows, V, "cpu")
    allowed = [
        kept_reference((base[i] / temperature).double().numpy(), k, p, m)
        for i, (k, p, m) in enumerate(ROW_SETTINGS)
    ]
    sampler = Sampler(torch.Generator().manual_seed(5))
    for _ in range(50):
        for i, token in enumerate(sampler(base, batch).sampled_token_ids.tolist()):
            assert token in allowed[i]


def test_disabled_filters_build_nothing() -> None:
    rows = [
        SamplingRow(SamplingParams(top_k=-1, top_p=1.0, min_p=0.0), []),
        SamplingRow(SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.2), []),
    ]  # greedy ignores them
    batch = SamplingBatch.build(rows, V, "cpu")
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
