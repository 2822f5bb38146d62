"""logit_bias, min_tokens and penalties against the OpenAI / vLLM formulas written out by hand, per token."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

from candle_vllm.pyengine.sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow

V = 50


def expected_row(logits: Sequence[float], row: SamplingRow, eos: set[int]) -> list[float]:
    """The formulas, token by token, in vLLM's order: bias, min_tokens, repetition, frequency, presence."""
    p = row.params
    out = list(logits)
    for token, bias in p.logit_bias.items():
        out[token] += bias
    if len(row.output_token_ids) < p.min_tokens:
        for token in set(p.stop_token_ids) | eos:
            out[token] = -math.inf
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    counts = Counter(row.output_token_ids)
    for token in range(len(out)):
        if token in seen:
            out[token] = (
                out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
            )
        out[token] -= p.frequency_penalty * counts[token]
        if counts[token] > 0:
            out[token] -= p.presence_penalty
    return out


def make_rows() -> list[SamplingRow]:
    return [
        SamplingRow(SamplingParams(repetition_penalty=1.3), [3, 4, 4], [1, 2, 3, 3]),
        SamplingRow(SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), [5, 5, 5, 6], [7, 8]),
        SamplingRow(
            SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5),
            [11, 12, 12],
            [10, 11],
        ),
        # Bias is added before the repetition penalty scales the logit.
        SamplingRow(
            SamplingParams(logit_bias={0: 5.0, 49: -100.0, 20: -3.0}, repetition_penalty=2.0), [20], [0, 20]
        ),
        SamplingRow(SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), [9], [9, 9, 9]),  # 1st token
        SamplingRow(SamplingParams(min_tokens=3, stop_token_ids=[8, 31]), [1, 2], [4]),
        SamplingRow(SamplingParams(min_tokens=3, stop_token_ids=[8]), [1, 2, 3], [4]),  # reached
        SamplingRow(SamplingParams(), [1, 1, 1], [2, 2]),  # untouched
    ]


def test_processed_logits_follow_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    rows = make_rows()
    logits = torch.randn(len(rows), V, generator=g) * 4
    logits[:, :25] = logits[:, :25].abs()  # make sure both signs meet the repetition penalty
    logits[:, 25:] = -logits[:, 25:].abs()
    logits[:, 31] = 3.0
    logits[:, 12] = -2.0
    eos = {9, 33}
    batch = SamplingBatch.build(rows, V, "cpu", eos_token_ids=eos)
    got = Sampler.process_logits(logits, batch)
    want = torch.tensor([expected_row(logits[i].tolist(), row, eos) for i, row in enumerate(rows)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    assert torch.isinf(got[5, [8, 9, 31, 33]]).all() and not torch.isinf(got[6]).any()
    assert torch.equal(got[7], logits[7])


def test_rows_without_penalties_build_no_penalty_state() -> None:
    batch = SamplingBatch.build([SamplingRow(SamplingParams(), [1, 2], [3])], V, "cpu")
    assert batch.penalties is None and batch.logit_bias is None and batch.banned is None


def test_greedy_choice_uses_processed_logits() -> None:
    g = torch.Generator().manual_seed(1)
    rows = [
        SamplingRow(r.params.with_defaults({"temperature": 0.0}), r.output_token_ids, r.prompt_token_ids)
        for r in make_rows()
    ]
    for _ in range(5):
        logits = torch.randn(len(rows), V, generator=g)
        batch = SamplingBatch.build(rows, V, "cpu", eos_token_ids={9})
        got = Sampler()(logits, batch).sampled_token_ids.tolist()
        want = [
            max(range(V), key=expected_row(logits[i].tolist(), row, {9}).__getitem__)
            for i, row in enumerate(rows)
        ]
        assert got == want
        for row, token in zip(rows, got, strict=True):
            row.output_token_ids = [*row.output_token_ids, token]
