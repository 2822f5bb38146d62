"""Host-side parts of the fresh-prompt prefill route (``ops/sdpa_prefill.py``): the backend switch and the split of
a step into runs of sequences without a cached prefix. The kernels themselves are checked on the GPU in
``tests/native/test_cuda_prefill_sdpa.py``."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from candle_vllm.pyengine.ops import sdpa_prefill
from candle_vllm.pyengine.ops.attention import AttentionMetadata


@pytest.mark.parametrize("value,want", [("", "auto"), ("auto", "auto"),
                                        ("native", "native"), (" SDPA-cuDNN ", "sdpa-cudnn"),
                                        ("sdpa-flash", "sdpa-flash")])
def test_backend_switch(monkeypatch: pytest.MonkeyPatch, value: str, want: str) -> None:
    monkeypatch.setenv(sdpa_prefill.ENV, value)
    assert sdpa_prefill.prefill_backend() == want


def test_unknown_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sdpa_prefill.ENV, "sdpa-math")
    with pytest.raises(ValueError, match="CANDLE_VLLM_PREFILL='sdpa-math' is not supported; use one of auto"):
        sdpa_prefill.prefill_backend()


def test_fresh_runs_on_random_steps() -> None:
    """Against the definition applied row by row: a row belongs to a fresh run iff its sequence has more than one
    new token and no cached prefix, and runs break exactly where a non-fresh sequence sits between fresh ones."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 7)
        q_lens = [rng.choice([0, 1, 1, 2, 5, 37]) for _ in range(n)]
        seq_lens = [q + rng.choice([0, 0, 3]) for q in q_lens]
        seq_lens = [max(s, 1) for s in seq_lens]
        meta = AttentionMetadata.build(q_lens, seq_lens)
        runs = meta.fresh_runs
        fresh = [q == s and q > 1 for q, s in zip(q_lens, seq_lens, strict=True)]
        owner = [s for s, q in enumerate(q_lens) for _ in range(q)]
        covered = [False] * len(owner)
        for run in runs:
            assert run.lens == [q_lens[s] for s in range(run.first, run.last)]
            assert all(fresh[run.first : run.last])
            assert run.end - run.start == sum(run.lens) and owner[run.start] == run.first
            assert owner[run.end - 1] == run.last - 1
            covered[run.start : run.end] = [True] * (run.end - run.start)
        assert covered == [fresh[s] for s in owner]
        for a, b in itertools.pairwise(runs):  # maximal: a sequence that is not fresh separates two runs
            assert a.last < b.first and not any(fresh[a.last : b.first])


def test_cu_seqlens_are_the_run_offsets() -> None:
    meta = AttentionMetadata.build([3, 5, 2, 4], [3, 5, 9, 4])
    first, second = meta.fresh_runs
    assert (first.start, first.end, first.max_len) == (0, 8, 5)
    assert first.cu_seqlens(torch.device("cpu")).tolist() == [0, 3, 8]
    assert (second.start, second.end) == (10, 14) and second.cu_seqlens(torch.device("cpu")).tolist() == [0, 4]


def test_sliding_window_softcap_and_f32_stay_native() -> None:
    q = torch.randn(6, 4, 64)
    k = v = torch.randn(6, 2, 64)
    assert not sdpa_prefill.sdpa_eligible("sdpa-flash", q, k, v, None, None)  # f32 on the host
    assert not sdpa_prefill.sdpa_eligible("native", q.half(), k.half(), v.half(), None, None)
