"""The serving actors with the executor's launch-ahead pipeline, on a tiny random Llama: every request's
streamed tokens equal the serial drive's, aborts mid-stream end only their request (what was streamed is a
prefix of the full output, nothing repeated), and a step that raises fails only its own requests."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pyengine"))
from pipeline_cases import fail_forward_on_call, random_prompts, serial_generate, tiny_llm, tiny_model_dir

from candle_vllm import LLM, SamplingParams
from candle_vllm.actors import AsyncEngine
from candle_vllm.pyengine.scheduler.plan import StepPlan


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return tiny_llm(tiny_model_dir(tmp_path_factory.mktemp("tiny_llama")))


def _params(rng: random.Random, i: int) -> SamplingParams:
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.9, seed=i, n=2, max_tokens=rng.randint(1, 20), ignore_eos=True)
    if kind == 2:
        return SamplingParams(temperature=0, presence_penalty=0.7, max_tokens=rng.randint(1, 20), ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True, stop=["t1"])


def test_streams_and_aborts_through_the_actors_match_serial(llm: LLM) -> None:
    rng = random.Random(11)
    prompts = random_prompts(rng, 20)
    params = [_params(rng, i) for i in range(len(prompts))]
    want = serial_generate(llm.engine, prompts, params)
    aborted = {3, 8, 13}  # leave after two outputs
    runner = llm.engine.runner
    overlapped = runner.stats.overlapped

    async def main() -> dict[int, list[tuple[list[int], list[int], str | None]]]:
        engine = AsyncEngine(llm.engine)
        got: dict[int, list[tuple[list[int], list[int], str | None]]] = {}

        async def one(i: int) -> None:
            await trio.sleep(0.002 * (i % 5))  # arrive while others run
            streamed: list[list[int]] = [[] for _ in range(params[i].n)]
            seen = 0
            final = None
            async for out in engine.generate(prompts[i], params[i], f"req-{i}"):
                for c in out.outputs:
                    streamed[c.index].extend(c.token_ids_delta)
                final = out
                seen += 1
                if i in aborted and seen == 2:
                    break
            assert final is not None
            got[i] = [(streamed[c.index], c.token_ids, c.finish_reason) for c in final.outputs]

        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            async with trio.open_nursery() as clients:
                for i in range(len(prompts)):
                    clients.start_soon(one, i)
            with trio.fail_after(30):
                while engine.stats().num_running or engine.stats().num_waiting or engine.stats().kv_usage:
                    await trio.sleep(0.01)  # the aborts are applied between steps
            nursery.cancel_scope.cancel()
        return got

    got = trio.run(main)
    for i, summary in enumerate(want):
        for (streamed, token_ids, reason), (want_ids, _, want_reason, _) in zip(got[i], summary, strict=True):
            assert streamed == token_ids, f"request {i}: deltas add up to the tokens"
            if i in aborted:
                assert token_ids == list(want_ids[: len(token_ids)]), f"request {i}"
            else:
                assert (token_ids, reason) == (list(want_ids), want_reason), f"request {i}"
    assert runner.stats.overlapped > overlapped, "the executor never launched a step before reading one back"
    assert llm.engine.scheduler.kv.usage == 0.0


def test_a_failing_step_fails_only_its_requests(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(12)
    prompts = random_prompts(rng, 2)
    late = random_prompts(rng, 3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = serial_generate(llm.engine, late, [params] * len(late))
    calls = fail_forward_on_call(llm, monkeypatch, 4)

    async def main() -> tuple[list[str | None], list[list[int]]]:
        engine = AsyncEngine(llm.engine)
        early: list[str | None] = []
        later: list[list[int]] = []

        async def first(i: int) -> None:
            async for out in engine.generate(prompts[i], params, f"early-{i}"):
                last = out
            early.append(last.outputs[0].finish_reason)

        async def second(i: int) -> None:
            async for out in engine.generate(late[i], params, f"late-{i}"):
                last = out
            later.append(last.outputs[0].token_ids)

        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            async with trio.open_nursery() as clients:
                for i in range(len(prompts)):
                    clients.start_soon(first, i)
            assert calls() >= 4
            async with trio.open_nursery() as clients:
                for i in range(len(late)):
                    clients.start_soon(second, i)
            nursery.cancel_scope.cancel()
        return early, later

    early, later = trio.run(main)
    assert early == ["abort", "abort"]
    assert sorted(later) == sorted(list(w[0][0]) for w in want)
    assert llm.engine.scheduler.kv.usage == 0.0


def _empty_plan(finished_ids: list[str]) -> StepPlan:
    """What the scheduler returns when nothing can run (every request waits on an in-flight result): no rows,
    but the ids of the requests that ended since the previous plan."""
    ints = np.zeros(0, dtype=np.int64)
    return StepPlan(-1, [], [], [], [], ints, ints, ints, np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.int32),
                    np.zeros((0, 0), dtype=np.int32), ints, finished_ids=finished_ids)


def test_ended_requests_reach_the_runner_through_empty_plans(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whenever requests have ended and a step is in flight, the scheduler first answers with an empty plan
    carrying their ids (as it does when every running request waits on an in-flight result). The actor does
    not send empty plans, so the ids must ride on the next plan: afterwards the runner holds state for none."""
    core = llm.engine
    scheduler, real_schedule, real_apply = core.scheduler, core.schedule, core.apply
    in_flight = 0

    def schedule_with_idle_plans() -> StepPlan:
        nonlocal in_flight
        if scheduler._finished_ids and in_flight:  # drained into an empty plan, as Scheduler.schedule does
            ids, scheduler._finished_ids = scheduler._finished_ids, []
            return _empty_plan(ids)
        plan = real_schedule()
        in_flight += not plan.is_empty
        return plan

    def counted_apply(*args: Any, **kwargs: Any) -> Any:
        nonlocal in_flight
        in_flight -= 1
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(core, "schedule", schedule_with_idle_plans)
    monkeypatch.setattr(core, "apply", counted_apply)
    rng = random.Random(13)
    prompts = random_prompts(rng, 6)

    async def main() -> None:
        engine = AsyncEngine(core)

        async def one(i: int, max_tokens: int) -> None:
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True)
            async for _ in engine.generate(prompts[i], params, f"idle-{i}"):
                pass

        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            async with trio.open_nursery() as clients:
                for i in range(5):
                    clients.start_soon(one, i, 3 + 4 * i)  # they end at different steps, while others run
            await one(5, 4)  # a later request's plans carry the last ids
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert core.runner.tracked_requests() <= {"idle-5"}, core.runner.tracked_requests()
