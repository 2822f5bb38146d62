"""The step pipeline (``ModelRunner.launch``/``collect``, ``EngineCore.step`` with two steps in flight) against
the strictly serial drive on a tiny random Llama: identical tokens, texts and finish reasons for greedy, seeded
sampling, penalties (a fallback), min_tokens, stop strings, ``n > 1``, max_tokens 1, requests ending at
different steps and preemption; plus proof that a plain greedy batch really overlaps its steps."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from pipeline_cases import (
    pipelined_generate,
    random_prompts,
    serial_generate,
    tiny_llm,
    tiny_model_dir,
)

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.kv_cache import kv_bytes_per_token
from candle_vllm.pyengine.runner import ModelRunner, PendingStep, StepResult
from candle_vllm.pyengine.scheduler.plan import StepPlan


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return tiny_llm(model_dir)


class StepOrder:
    """Records the order of the runner's launches and read-backs (a spy: the real methods still run)."""

    def __init__(self, runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, int]] = []
        launch, collect = runner.launch, runner.collect

        def spy_launch(plan: StepPlan) -> PendingStep:
            step = launch(plan)
            if not plan.is_empty:
                self.events.append(("launch", plan.step_id))
            return step

        def spy_collect(step: PendingStep) -> StepResult:
            self.events.append(("collect", step.plan.step_id))
            return collect(step)

        monkeypatch.setattr(runner, "launch", spy_launch)
        monkeypatch.setattr(runner, "collect", spy_collect)

    def launched_before_collect(self) -> tuple[int, int]:
        """(steps whose successor was launched before they were collected, steps with a successor)."""
        where = {event: i for i, event in enumerate(self.events)}
        launched = sorted(step for kind, step in self.events if kind == "launch")
        pairs = list(itertools.pairwise(launched))
        ahead = sum(where[("launch", nxt)] < where[("collect", cur)] for cur, nxt in pairs)
        return ahead, len(pairs)


def _stats(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.runner.stats
    return s.launched, s.overlapped, s.serialized


def test_greedy_batch_overlaps_every_step_and_matches_serial(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(1)
    prompts = random_prompts(rng, 24)
    params = [SamplingParams(temperature=0, max_tokens=rng.choice([1, 2, 5, 17, 30]), ignore_eos=True)
              for _ in prompts]
    want = serial_generate(llm.engine, prompts, params)
    order = StepOrder(llm.engine.runner, monkeypatch)
    before = _stats(llm)
    got = pipelined_generate(llm, prompts, params)
    assert got == want
    assert [len(s[0][0]) for s in got] == [p.max_tokens for p in params]
    ahead, pairs = order.launched_before_collect()
    assert pairs >= 25 and ahead == pairs, f"only {ahead} of {pairs} steps had their successor launched first"
    launched, overlapped, serialized = (a - b for a, b in zip(_stats(llm), before, strict=True))
    assert serialized == 0 and overlapped == launched - 1


def test_steady_decode_feeds_the_sampled_ids_as_they_are(llm: LLM) -> None:
    """Once the batch stops changing, each step's inputs are the previous step's sampled ids in the same rows:
    the runner hands that device tensor over without host copies or gathers, and the tokens match serial."""
    rng = random.Random(7)
    prompts = random_prompts(rng, 3)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in prompts]
    want = serial_generate(llm.engine, prompts, params)
    before = llm.engine.runner.stats.fed_as_sampled
    assert pipelined_generate(llm, prompts, params) == want
    assert llm.engine.runner.stats.fed_as_sampled - before >= 25


def test_seeded_sampling_and_n_match_serial(llm: LLM) -> None:
    rng = random.Random(2)
    prompts = random_prompts(rng, 10)
    params = [
        SamplingParams(temperature=rng.choice([0.7, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9]),
                       top_k=rng.choice([0, 20]), min_p=rng.choice([0.0, 0.05]), seed=100 + i,
                       n=rng.choice([1, 1, 3]), max_tokens=rng.randint(1, 24), ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    want = serial_generate(llm.engine, prompts, params)
    before = _stats(llm)
    got = pipelined_generate(llm, prompts, params)
    assert got == want
    assert any(len(set(choices)) > 1 for choices in got), "n > 1 choices with their own seeds should differ"
    assert _stats(llm)[2] == before[2], "seeded sampling needs no fallback"


def test_penalties_and_min_tokens_fall_back_and_match_serial(llm: LLM) -> None:
    rng = random.Random(3)
    prompts = random_prompts(rng, 12)
    stop_id = 7
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=0.8),
        SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, repetition_penalty=1.4),
        SamplingParams(temperature=0.9, seed=5, max_tokens=18, ignore_eos=True, presence_penalty=1.1),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop_id],
                       logit_bias={stop_id: 30.0}),  # would stop at once but for min_tokens
    ] * 3
    want = serial_generate(llm.engine, prompts, params)
    assert all(len(s[0][0]) == 7 and s[0][0][-1] == stop_id and s[0][2] == "stop" for s in want[3::4]), \
        "six tokens (min_tokens), then the stop id"
    before = _stats(llm)
    got = pipelined_generate(llm, prompts, params)
    assert got == want
    assert _stats(llm)[2] > before[2], "rows reading their sampled history must serialize their steps"


def test_stop_strings_and_stop_tokens_match_serial(llm: LLM) -> None:
    rng = random.Random(4)
    prompts = random_prompts(rng, 8)
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = serial_generate(llm.engine, prompts, [free] * len(prompts))
    params = []
    for (choice,) in plain:  # stop on a word each output really produces, somewhere in its middle
        words = choice[1].split()
        params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                     stop=[words[len(words) // 2]], stop_token_ids=[int(words[-3][1:])]))
    want = serial_generate(llm.engine, prompts, params)
    assert all(s[0][2] == "stop" for s in want)
    assert pipelined_generate(llm, prompts, params) == want


def test_requests_arriving_between_steps_match_serial(llm: LLM) -> None:
    rng = random.Random(5)
    prompts = random_prompts(rng, 16)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    want = serial_generate(llm.engine, prompts, params)
    engine = llm.engine
    pending = list(range(len(prompts)))
    got: dict[int, tuple] = {}
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i = pending.pop(0)
                engine.add_request(f"arrive-{i}", prompts[i], params[i])
        for out in engine.step():
            if out.finished:
                got[int(out.request_id.split("-")[1])] = tuple(
                    (tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in out.outputs)
    assert [got[i] for i in range(len(prompts))] == want


def test_preemption_under_a_tiny_cache_matches_serial(model_dir: Path, llm: LLM) -> None:
    rng = random.Random(6)
    prompts = random_prompts(rng, 16, 20, 60)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in prompts]
    want = serial_generate(llm.engine, prompts, params)
    cfg = llm.engine.model_config
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    longest = max(len(p) for p in prompts) + 40
    small = tiny_llm(model_dir, block_size=16, mem=-(-int(3.5 * longest * per_token) // 2**20))
    assert small.engine.info.kv_capacity_tokens < 6 * longest, "the cache must force preemption"
    preempted = 0
    schedule = small.engine.schedule

    def counting_schedule() -> StepPlan:
        nonlocal preempted
        plan = schedule()
        preempted += len(plan.preempted_ids)
        return plan

    small.engine.schedule = counting_schedule
    assert pipelined_generate(small, prompts, params) == want
    assert preempted > 0
    assert small.engine.scheduler.kv.usage == 0.0 and not small.engine.has_unfinished()


def test_aborts_between_pipelined_steps_lose_and_duplicate_nothing(llm: LLM) -> None:
    rng = random.Random(7)
    prompts = random_prompts(rng, 10)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    want = serial_generate(llm.engine, prompts, [params] * len(prompts))
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params)
    streamed: dict[str, list[int]] = {f"a{i}": [] for i in range(len(prompts))}
    finals = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id].extend(out.outputs[0].token_ids_delta)
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        if steps in (4, 9):
            for rid in (f"a{steps % 7}", f"a{steps}"):
                final = engine.abort(rid)
                if final is not None:
                    finals[rid] = final
                    streamed[rid].extend(final.outputs[0].token_ids_delta)
    for i in range(len(prompts)):
        rid, tokens = f"a{i}", list(want[i][0][0])
        completion = finals[rid].outputs[0]
        assert streamed[rid] == completion.token_ids, (
            "deltas add up to the final tokens, none lost or repeated")
        if i in (2, 4, 9):
            assert completion.finish_reason == "abort" and 0 < len(completion.token_ids) < len(tokens)
            assert completion.token_ids == tokens[: len(completion.token_ids)]
        else:
            assert completion.token_ids == tokens
    assert engine.scheduler.kv.usage == 0.0


def test_placeholder_of_a_collected_step_comes_from_the_host(llm: LLM) -> None:
    """A step planned before its predecessor's tokens were applied, but launched after that step was read back
    (the executor flushed it): its placeholders take the host path and give the same tokens."""
    rng = random.Random(8)
    prompts = random_prompts(rng, 6)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(prompts)
    want = serial_generate(llm.engine, prompts, params)
    core = llm.engine
    for i, p in enumerate(prompts):
        core.add_request(f"h{i}", p, params[i])
    done = {}
    while core.has_unfinished():
        plan = core.schedule()
        if plan.is_empty:
            core.runner.launch(plan)
            continue
        result = core.runner.execute(plan)  # read back at once ...
        nxt = core.schedule()  # ... but the next plan is made before the tokens are applied
        outputs, _ = core.process(core.apply(plan, result))
        later = core.runner.execute(nxt)
        if not nxt.is_empty:
            assert (nxt.input_ids < 0).any()
            outputs += core.process(core.apply(nxt, later))[0]
        done.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
    assert [tuple(done[f"h{i}"]) for i in range(len(prompts))] == [w[0][0] for w in want]


@pytest.mark.cuda
def test_gpu_with_cuda_graphs_pipelined_matches_serial(model_dir: Path) -> None:
    """On the GPU with decode graphs: the pipelined loop (placeholders gathered on the device and copied into the
    graphs' input buffer) gives the serial drive's tokens, for greedy, seeded sampling and penalties."""
    gpu = tiny_llm(model_dir, cpu=False, dtype="bf16", mem=64, max_num_seqs=64)
    assert gpu.engine.info.device.type == "cuda"
    runner = gpu.engine.runner
    graphs = runner.graphs
    assert graphs is not None, "CUDA graphs must be on for this test"
    device_ids = []
    real_run = graphs.run

    def spy_run(
        bucket: int, input_ids: np.ndarray | torch.Tensor, *rest: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device_ids.append(isinstance(input_ids, torch.Tensor) and input_ids.is_cuda)
        return real_run(bucket, input_ids, *rest)

    graphs.run = spy_run
    rng = random.Random(9)
    for batch in (1, 5, 32):
        prompts = random_prompts(rng, batch)
        params = [
            SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True) if i % 3 == 0 else
            SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=rng.randint(1, 40), ignore_eos=True)
            if i % 3 == 1 else
            SamplingParams(temperature=0, frequency_penalty=0.5, max_tokens=rng.randint(1, 40), ignore_eos=True)
            for i in range(batch)
        ]
        want = serial_generate(gpu.engine, prompts, params)
        assert pipelined_generate(gpu, prompts, params) == want, f"batch {batch}"
    plain = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)] * 48
    prompts = random_prompts(rng, 48)
    served = len(device_ids)
    want = serial_generate(gpu.engine, prompts, plain)
    assert len(device_ids) - served >= 55 and not any(device_ids[served:]), "serial: graphs, no placeholders"
    served = len(device_ids)
    before = (runner.stats.launched, runner.stats.overlapped, runner.stats.serialized)
    assert pipelined_generate(gpu, prompts, plain) == want
    assert sum(device_ids[served:]) >= 55, "decode replays must take their ids from the previous step on the device"
    launched, overlapped, serialized = (
        a - b for a, b in zip((runner.stats.launched, runner.stats.overlapped, runner.stats.serialized), before,
                              strict=True))
    assert serialized == 0 and overlapped == launched - 1
