"""Logprobs are the raw model log-probabilities (float64 numpy log-softmax), with top-k and ranks."""

from __future__ import annotations

import numpy as np
import torch

from candle_vllm.pyengine.sampling import (
    Sampler,
    SamplingBatch,
    SamplingParams,
    SamplingRow,
    make_generator,
    prompt_logprobs,
)

V = 200


def log_softmax64(x: torch.Tensor) -> np.ndarray:
    a = x.double().numpy()
    shifted = a - a.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def test_sampled_logprobs_are_raw_and_topk_is_ranked() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)) * 4
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, top_k=20, logprobs=20, logit_bias={5: 30.0}, seed=1),
        SamplingParams(temperature=1.3, logprobs=0, frequency_penalty=1.0, seed=2),
        SamplingParams(temperature=1.0),  # no logprobs asked
        SamplingParams(temperature=2.0, min_p=0.01, logprobs=5, seed=3),
    ]
    rows = [
        SamplingRow(p, [7, 7, 9], [1, 2], make_generator(p.seed, "cpu") if p.seed is not None else None)
        for p in params
    ]
    batch = SamplingBatch.build(rows, V, "cpu")
    out = Sampler()(logits, batch)
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (5, 21)
    ref = log_softmax64(logits)
    sampled = out.sampled_token_ids.numpy()
    np.testing.assert_allclose(out.logprobs.logprobs[:, 0].numpy(), ref[np.arange(5), sampled], atol=1e-5)
    torch.testing.assert_close(
        out.logprobs.logprobs[:, 0],
        torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None])[:, 0],
    )
    np.testing.assert_array_equal(
        out.logprobs.ranks.numpy(), (ref > ref[np.arange(5), sampled][:, None]).sum(axis=1) + 1
    )
    best = np.argsort(-ref, axis=1)[:, :20]
    np.testing.assert_array_equal(out.logprobs.token_ids[:, 1:].numpy(), best)
    np.testing.assert_allclose(
        out.logprobs.logprobs[:, 1:].numpy(), np.take_along_axis(ref, best, 1), atol=1e-5
    )

    lists = out.logprobs.tolists(batch.num_logprobs)
    assert lists[3] is None
    for i, k in enumerate([3, 20, 0, None, 5]):
        entry = lists[i]
        if k is None:
            continue
        assert entry is not None
        token = int(sampled[i])
        assert next(iter(entry)) == token and entry[token].rank == int(out.logprobs.ranks[i])
        assert set(entry) == {token, *best[i, :k].tolist()}
        assert len(entry) == (k if token in best[i, :k] else k + 1)
        for pos, alt in enumerate(best[i, :k].tolist()):
            assert abs(entry[alt].logprob - ref[i, alt]) < 1e-5
            assert entry[alt].rank == pos + 1


def test_prompt_logprobs_chunked_matches_reference() -> None:
    t = 11
    logits = torch.randn(t, V, generator=torch.Generator().manual_seed(3)) * 2
    targets = torch.randint(0, V, (t,), generator=torch.Generator().manual_seed(4))
    ref = log_softmax64(logits)
    whole = prompt_logprobs(logits, targets, num_top=4)
    chunked = prompt_logprobs(logits, targets, num_top=4, chunk_rows=3)
    for got in (whole, chunked):
        np.testing.assert_array_equal(got.token_ids[:, 0].numpy(), targets.numpy())
        np.testing.assert_allclose(got.logprobs[:, 0].numpy(), ref[np.arange(t), targets.numpy()], atol=1e-5)
        np.testing.assert_array_equal(got.token_ids[:, 1:].numpy(), np.argsort(-ref, axis=1)[:, :4])
        np.testing.assert_array_equal(
            got.ranks.numpy(), (ref > ref[np.arange(t), targets.numpy()][:, None]).sum(axis=1) + 1
        )
    empty = prompt_logprobs(logits[:0], targets[:0], num_top=2)
    assert empty.token_ids.shape == (0, 3)
