"""build_step_arrays against a per-token Python construction of the same step on random requests."""

from __future__ import annotations

import random

import numpy as np
import pytest

from candle_vllm.pyengine.kv_cache import build_step_arrays


def reference(tables: np.ndarray, bs: int, rows: list[int], starts: list[int], counts: list[int],
              prompts: list[list[int]], outputs: list[list[int]], samples: list[bool]) -> list[np.ndarray]:
    ids, pos, slots, qsl, seq, smp = [], [], [], [0], [], []
    for row, start, count, prompt, output, s in zip(rows, starts, counts, prompts, outputs, samples, strict=True):
        known = prompt + output
        for p in range(start, start + count):
            ids.append(known[p] if p < len(known) else -1)
            pos.append(p)
            slots.append(int(tables[row, p // bs]) * bs + p % bs)
        qsl.append(qsl[-1] + count)
        seq.append(start + count)
        if s:
            smp.append(qsl[-1] - 1)
    width = max(-(-n // bs) for n in seq)
    bt = np.zeros((len(rows), width), dtype=np.int32)
    for i, (row, n) in enumerate(zip(rows, seq, strict=True)):
        nb = -(-n // bs)
        bt[i, :nb] = tables[row, :nb]
    return [np.array(ids), np.array(pos), np.array(slots), np.array(qsl), np.array(seq), bt, np.array(smp)]


@pytest.mark.parametrize("seed", range(5))
def test_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    bs, max_rows, width = 8, 12, 40
    tables = np.array([rng.sample(range(1000), width) for _ in range(max_rows)], dtype=np.int32)
    rows = rng.sample(range(max_rows), 7)
    prompts, outputs, starts, counts, samples = [], [], [], [], []
    for _ in rows:
        prompt = [rng.randrange(32000) for _ in range(rng.randrange(1, 150))]
        output = [rng.randrange(32000) for _ in range(rng.randrange(0, 100))]
        known = len(prompt) + len(output)
        pending = rng.choice([0, 0, 1, 2])  # in-flight samples appear as -1 ids
        start = rng.randrange(0, known)
        counts.append(known + pending - start if rng.random() < 0.6 else rng.randrange(1, known - start + 1))
        starts.append(start)
        prompts.append(prompt)
        outputs.append(output)
        samples.append(start + counts[-1] >= known)
    got = build_step_arrays(tables, bs, rows, starts, counts, prompts, outputs, samples)
    want = reference(tables, bs, rows, starts, counts, prompts, outputs, samples)
    dtypes = [np.int64, np.int64, np.int64, np.int32, np.int32, np.int32, np.int64]
    for g, w, dt in zip(got, want, dtypes, strict=True):
        assert g.dtype == dt
        np.testing.assert_array_equal(g, w.astype(dt))


def test_rejects_bad_input() -> None:
    tables = np.zeros((2, 4), dtype=np.int32)
    with pytest.raises(ValueError, match="needs tokens"):
        build_step_arrays(tables, 4, [0], [0], [0], [[1]], [[]], [True])
    with pytest.raises(ValueError, match="blocks"):
        build_step_arrays(tables, 4, [0], [0], [17], [[1] * 17], [[]], [True])
    with pytest.raises(ValueError, match="outside"):
        build_step_arrays(tables, 4, [5], [0], [1], [[1]], [[]], [True])
    with pytest.raises(ValueError, match="differ in length"):
        build_step_arrays(tables, 4, [0, 1], [0], [1], [[1]], [[]], [True])
