"""Token masks in the batched sampler: the mask bias against a per-bit reference, only constrained rows touched,
sampled tokens always allowed, greedy = argmax over the allowed set, logprobs taken after the mask (as vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from candle_vllm.pyengine.sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow, make_generator
from candle_vllm.pyengine.sampling.token_mask import TokenMask, apply_token_mask, mask_bias


def random_bitmask(rows: int, words: int, seed: int, density: float = 0.3) -> torch.Tensor:
    """int32 words with each bit set with probability ``density`` (sign bit included)."""
    rng = np.random.default_rng(seed)
    bits = rng.random((rows, words, 32)) < density
    packed = (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=-1).astype(np.uint32)
    return torch.from_numpy(packed.view(np.int32))


def reference_allowed(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    words = bitmask.numpy().view(np.uint32)
    out = np.zeros((words.shape[0], vocab), dtype=bool)
    for r in range(words.shape[0]):
        for t in range(min(vocab, 32 * words.shape[1])):
            out[r, t] = bool((int(words[r, t // 32]) >> (t % 32)) & 1)
    return out


@pytest.mark.parametrize("vocab", [1000, 1024, 1100])  # inside the last word, exactly full, past the mask
def test_mask_bias_matches_per_bit_reference(vocab: int) -> None:
    bitmask = random_bitmask(5, 32, seed=vocab)
    bias = mask_bias(bitmask, vocab).numpy()
    assert bias.shape == (5, vocab) and bias.dtype == np.float32
    allowed = reference_allowed(bitmask, vocab)
    assert (bias[allowed] == 0).all() and np.isneginf(bias[~allowed]).all()
    if vocab > 1024:
        assert np.isneginf(bias[:, 1024:]).all()


def test_apply_touches_constrained_rows_only() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    bitmask = random_bitmask(2, 10, seed=1)
    apply_token_mask(logits, TokenMask(torch.tensor([4, 1]), bitmask))
    allowed = reference_allowed(bitmask, 300)
    for k, row in enumerate([4, 1]):
        assert torch.isneginf(logits[row][~torch.from_numpy(allowed[k])]).all()
        assert torch.equal(logits[row][allowed[k]], before[row][allowed[k]])
    for row in (0, 2, 3, 5):
        assert torch.equal(logits[row], before[row])


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x[np.isfinite(x)].max()
    return x - m - np.log(np.exp(x - m).sum())


def sample(logits: torch.Tensor, params: list[SamplingParams], seed: int, mask: TokenMask | None
           ) -> tuple[list[int], list]:
    rows = [SamplingRow(p, [], generator=make_generator(p.seed, "cpu") if p.seed else None) for p in params]
    batch = SamplingBatch.build(rows, logits.shape[1], "cpu", token_mask=mask)
    out = Sampler(torch.Generator().manual_seed(seed))(logits, batch)
    assert out.logprobs is not None
    return out.sampled_token_ids.tolist(), out.logprobs.tolists(batch.num_logprobs)


def test_sampler_respects_masks_and_leaves_other_rows_alone() -> None:
    vocab, rows = 500, 8
    constrained = [1, 2, 5, 6]  # 1, 5 greedy; 2, 6 sampled (6 seeded)
    params = [SamplingParams(temperature=0.0 if i in (1, 5) else 1.0, seed=7 + i if i in (3, 6) else None,
                             logprobs=3) for i in range(rows)]
    bitmask = random_bitmask(len(constrained), (vocab + 31) // 32, seed=2, density=0.05)
    allowed = reference_allowed(bitmask, vocab)
    for step in range(20):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(100 + step)) * 4
        original = logits.clone()
        masked_ids, masked_lps = sample(logits, params, step, TokenMask(torch.tensor(constrained), bitmask))
        plain_ids, plain_lps = sample(logits, params, step, None)
        assert torch.equal(logits, original), "the sampler must not write into the caller's logits"
        for k, row in enumerate(constrained):
            assert allowed[k, masked_ids[row]], f"row {row} sampled a forbidden token"
            if params[row].is_greedy:
                candidates = np.where(allowed[k], logits[row].numpy(), -np.inf)
                assert masked_ids[row] == int(np.argmax(candidates))
            reference = log_softmax64(np.where(allowed[k], logits[row].numpy(), -np.inf))
            chosen = masked_lps[row][masked_ids[row]]
            assert chosen.logprob == pytest.approx(reference[masked_ids[row]], abs=1e-4)
        for row in set(range(rows)) - set(constrained):
            assert masked_ids[row] == plain_ids[row]
            assert masked_lps[row] == plain_lps[row]
