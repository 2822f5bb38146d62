"""The batched sampler: greedy, seeded reproducibility across batches, and frequencies vs softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from candle_vllm.pyengine.sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow, make_generator


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test over the categories with expected count >= 5 (the rest pooled into one bin)."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_zero_is_argmax() -> None:
    logits = random_logits(16, 1000, 0)
    batch = SamplingBatch.build(
        [SamplingRow(SamplingParams(temperature=0), []) for _ in range(16)], 1000, "cpu"
    )
    got = Sampler()(logits, batch).sampled_token_ids
    assert got.tolist() == np.argmax(logits.numpy(), axis=1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "params,token",
    [(SamplingParams(temperature=0), 200), (SamplingParams(temperature=0, logprobs=3), 200),
     (SamplingParams(temperature=0, repetition_penalty=1.3), 600),
     (SamplingParams(temperature=0, logit_bias={5: 40.0}), 5)],
)
def test_half_precision_logits_sample_as_their_f32_copy(
    dtype: torch.dtype, params: SamplingParams, token: int
) -> None:
    """The LM head's bf16/f16 logits come to the sampler unconverted: a plain greedy batch takes their argmax
    directly, the others convert first. A tie is planted at the top (tokens 200 and 600): the lower index wins,
    unless the penalty on the already generated 200 or the bias on 5 decides. Every token and logprob also equals
    what the f32 copy gives."""
    logits = random_logits(6, 700, 3).to(dtype)
    logits[:, 200] = logits[:, 600] = logits.float().max() + 1
    rows = [SamplingRow(params, [5, 200, 7]) for _ in range(6)]
    got = Sampler()(logits, SamplingBatch.build(rows, 700, "cpu"))
    want = Sampler()(logits.float(), SamplingBatch.build(rows, 700, "cpu"))
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert (got.logprobs is None) == (params.logprobs is None)
    if got.logprobs is not None and want.logprobs is not None:
        assert torch.equal(got.logprobs.logprobs, want.logprobs.logprobs)
    assert got.sampled_token_ids.tolist() == [token] * 6


def test_top_k_one_equals_greedy_for_seeded_and_unseeded_rows() -> None:
    logits = random_logits(8, 500, 1)
    rows = [
        SamplingRow(
            SamplingParams(temperature=1.5, top_k=1, seed=i if i % 2 else None),
            [],
            generator=make_generator(i, "cpu"),
        )
        for i in range(8)
    ]
    batch = SamplingBatch.build(rows, 500, "cpu")
    sampler = Sampler(torch.Generator().manual_seed(0))
    for _ in range(3):
        assert sampler(logits, batch).sampled_token_ids.tolist() == np.argmax(logits.numpy(), axis=1).tolist()


@pytest.mark.parametrize("random_top_k", [0, 5])
def test_mixed_batch_greedy_rows_unaffected_by_random_rows(random_top_k: int) -> None:
    logits = random_logits(6, 300, 2)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, top_k=random_top_k), [])
        for i in range(6)
    ]
    batch = SamplingBatch.build(rows, 300, "cpu")
    assert batch.top_k_on_every_row == (random_top_k > 0)
    out = Sampler()(logits, batch).sampled_token_ids
    argmax = logits.argmax(dim=-1)
    assert out[0] == argmax[0] and out[3] == argmax[3]
    if random_top_k:
        top = logits.topk(random_top_k, dim=-1).indices
        assert all(int(out[i]) in top[i].tolist() for i in range(6))


def run_request(position: int, others: list[SamplingParams], seed: int, steps: int = 8) -> list[int]:
    """Generate ``steps`` tokens for one seeded request placed at ``position`` among ``others``.

    Logits of every row are a function of (row's request, step) only, as a model's would be.
    """
    vocab = 400
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, frequency_penalty=0.3, seed=seed)
    params = [*others[:position], target, *others[position:]]
    generators = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    sampler = Sampler(torch.Generator().manual_seed(len(others) * 31 + position))
    for step in range(steps):
        logits = torch.stack(
            [random_logits(1, vocab, 1000 * step + (p is target) * 7 + i)[0] for i, p in enumerate(params)]
        )
        logits[position] = random_logits(1, vocab, 10_000 + step)[0]
        rows = [
            SamplingRow(p, out, [1, 2, 3], gen)
            for p, out, gen in zip(params, outputs, generators, strict=True)
        ]
        tokens = sampler(logits, SamplingBatch.build(rows, vocab, "cpu")).sampled_token_ids.tolist()
        for out, token in zip(outputs, tokens, strict=True):
            out.append(token)
    return outputs[position]


def test_seeded_request_reproducible_whatever_the_batch() -> None:
    alone = run_request(0, [], seed=1234)
    crowd = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, seed=99),
        SamplingParams(temperature=0.5, min_p=0.2),
        SamplingParams(repetition_penalty=1.2, logprobs=3),
    ]
    assert run_request(2, crowd, seed=1234) == alone
    assert run_request(4, crowd[::-1], seed=1234) == alone
    assert run_request(1, crowd[:2], seed=1234) == alone
    assert run_request(0, [], seed=4321) != alone


def test_frequencies_match_softmax_at_temperature_one() -> None:
    """20k unseeded draws over a 10-token vocabulary, one row each, against softmax in float64."""
    logits = torch.tensor([[1.2, -0.3, 0.0, 2.1, -1.5, 0.7, 0.2, -0.8, 1.6, -2.5]])
    draws = 20_000
    rows = [SamplingRow(SamplingParams(), []) for _ in range(draws)]
    tokens = Sampler(torch.Generator().manual_seed(7))(
        logits.expand(draws, -1), SamplingBatch.build(rows, 10, "cpu")
    )
    counts = np.bincount(tokens.sampled_token_ids.numpy(), minlength=10)
    assert chi_square_p_value(counts, softmax64(logits[0].double().numpy())) > 1e-3


def test_seeded_draws_follow_the_truncated_distribution() -> None:
    """5k requests, each with its own seed, at temperature 0.5 with top-k 6 and top-p 0.9."""
    logits = torch.tensor([[0.9, 0.1, 0.5, 1.1, -0.2, 0.8, 0.3, 0.0, 1.0, -0.5]])
    draws = 5_000
    rows = [
        SamplingRow(
            SamplingParams(temperature=0.5, top_k=6, top_p=0.9, seed=s),
            [],
            generator=make_generator(s, "cpu"),
        )
        for s in range(draws)
    ]
    tokens = Sampler()(logits.expand(draws, -1), SamplingBatch.build(rows, 10, "cpu")).sampled_token_ids
    scaled = logits[0].double().numpy() / 0.5
    order = np.argsort(-scaled)[:6]
    probs = softmax64(scaled[order])
    keep = int(np.searchsorted(np.cumsum(probs), 0.9)) + 1  # shortest prefix reaching 0.9
    want = np.zeros(10)
    want[order[:keep]] = softmax64(scaled[order[:keep]])
    counts = np.bincount(tokens.numpy(), minlength=10)
    assert counts[want == 0].sum() == 0
    assert chi_square_p_value(counts[want > 0], want[want > 0]) > 1e-3


def test_wrong_shapes_and_missing_generator_are_reported() -> None:
    batch = SamplingBatch.build([SamplingRow(SamplingParams(), [])], 10, "cpu")
    with pytest.raises(
        ValueError, match=r"logits of shape \(2, 10\) do not match the batch \(1 rows, vocab 10\)"
    ):
        Sampler()(torch.randn(2, 10), batch)
    with pytest.raises(ValueError, match="row 0 has seed=5 but no generator"):
        SamplingBatch.build([SamplingRow(SamplingParams(seed=5), [])], 10, "cpu")


@pytest.mark.cuda
def test_cuda_matches_cpu_semantics() -> None:
    device = torch.device("cuda")
    logits = random_logits(12, 32_000, 11).to(device)
    rows = [
        SamplingRow(
            SamplingParams(
                temperature=0.0 if i < 4 else 0.8,
                top_k=50 * (i % 3),
                top_p=0.9,
                min_p=0.05,
                repetition_penalty=1.1,
                seed=i,
                logprobs=5,
            ),
            [i, i + 1],
            [3, 4],
            make_generator(i, device),
        )
        for i in range(12)
    ]
    batch = SamplingBatch.build(rows, 32_000, device, eos_token_ids={2})
    first = Sampler()(logits, batch)
    want_greedy = Sampler.process_logits(logits, batch).argmax(dim=-1)[:4]
    assert torch.equal(first.sampled_token_ids[:4], want_greedy)
    rows_again = [
        SamplingRow(r.params, r.output_token_ids, r.prompt_token_ids, make_generator(i, device))
        for i, r in enumerate(rows)
    ]
    again = Sampler()(
        logits.flip(0), SamplingBatch.build(rows_again[::-1], 32_000, device, eos_token_ids={2})
    )
    assert torch.equal(again.sampled_token_ids.flip(0), first.sampled_token_ids)
    assert first.logprobs is not None
    torch.testing.assert_close(
        first.logprobs.logprobs[:, 0],
        torch.log_softmax(logits, -1).gather(1, first.sampled_token_ids[:, None])[:, 0],
    )


def test_min_p_cuts_before_top_p_measures_its_mass() -> None:
    """vLLM v1 applies min-p, then top-k/top-p to what it kept: probabilities [.5, .3, .15, .05] with min_p 0.2
    drop the last token (0.05 < 0.2 * 0.5); renormalized, the first two hold 0.842 >= top_p 0.83, so only they
    can be drawn. Filtering top-p first would keep the third token (0.5 + 0.3 < 0.83), which min-p then keeps."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    rows = [SamplingRow(SamplingParams(temperature=1.0, min_p=0.2, top_p=0.83, seed=i), [],
                        generator=make_generator(i, "cpu")) for i in range(2000)]
    drawn = Sampler()(logits, SamplingBatch.build(rows, 4, "cpu")).sampled_token_ids
    counts = torch.bincount(drawn, minlength=4).tolist()
    assert counts[2] == counts[3] == 0, counts
    assert 0.55 < counts[0] / 2000 < 0.70, counts  # 0.5 / 0.8 = 0.625


def test_allowed_token_ids_restrict_each_row_and_leave_logprobs_raw() -> None:
    """vLLM's allowed_token_ids: a greedy row takes the argmax over its list, a sampling row draws from the softmax
    over its list alone (chi-square against float64), rows without one are untouched, and the returned logprobs
    are the model's raw ones (vLLM v1 computes them before this mask)."""
    vocab, draws = 12, 8_000
    logits = random_logits(1, vocab, 11)[0]
    allowed = [2, 5, 9]
    greedy_row = SamplingRow(SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=2), [])
    free_row = SamplingRow(SamplingParams(temperature=0, logprobs=2), [])
    sampled = [SamplingRow(SamplingParams(allowed_token_ids=[9, 5, 2, 5]), []) for _ in range(draws)]
    rows = [greedy_row, free_row, *sampled]
    out = Sampler(torch.Generator().manual_seed(5))(logits.expand(len(rows), -1),
                                                   SamplingBatch.build(rows, vocab, "cpu"))
    tokens = out.sampled_token_ids.numpy()
    assert tokens[0] == allowed[int(np.argmax(logits[allowed].numpy()))]
    assert tokens[1] == int(np.argmax(logits.numpy()))
    assert out.logprobs is not None
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert float(out.logprobs.logprobs[0, 0]) == pytest.approx(float(raw[tokens[0]]), abs=1e-5)
    counts = np.bincount(tokens[2:], minlength=vocab)
    assert counts[[t for t in range(vocab) if t not in allowed]].sum() == 0
    assert chi_square_p_value(counts[allowed], softmax64(logits[allowed].double().numpy())) > 1e-3
    for bad in ([], [-1]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(allowed_token_ids=[3, vocab]).check_vocab(vocab)


def test_bad_words_ban_a_words_last_token_only_after_its_head() -> None:
    """vLLM's bad_words at the sampler: a one-token word is never chosen; a two-token word's second token is
    banned right after its first, and free anywhere else (greedy rows pick the next best, as argmax over the rest)."""
    vocab = 10
    logits = random_logits(1, vocab, 3)[0]
    order = [int(t) for t in torch.argsort(logits, descending=True)]
    best, second, third, head = order[0], order[1], order[2], order[-1]
    words = [[best], [head, second]]
    rows = [SamplingRow(SamplingParams(temperature=0, bad_words_token_ids=words), history)
            for history in ([order[4], head], [head, order[4]], [])]
    tokens = Sampler()(logits.expand(3, -1), SamplingBatch.build(rows, vocab, "cpu")).sampled_token_ids.tolist()
    assert tokens == [third, second, second]
