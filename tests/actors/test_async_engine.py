"""AsyncEngine (the actors, with the scheduler one step ahead of the results) against the synchronous offline
engine on the real SmolLM2 GGUF: the same requests give the same tokens, however they interleave."""

from __future__ import annotations

import trio

from candle_vllm import LLM, SamplingParams
from candle_vllm.actors import AsyncEngine
from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.engine_core import EngineCore

CASES = [
    ("The ocean is", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
    ("List three colors:", SamplingParams(temperature=0, max_tokens=24, frequency_penalty=1.5, ignore_eos=True)),
    ("def fib(n):", SamplingParams(temperature=0.8, seed=7, max_tokens=20, presence_penalty=0.5, ignore_eos=True)),
    ("Once upon a time", SamplingParams(temperature=0, max_tokens=30, stop=["."], ignore_eos=True)),
    ("Hello, my name is", SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True)),
    ("1, 2, 3,", SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, logprobs=2)),
]


def test_async_engine_matches_offline_engine() -> None:
    offline = LLM()
    want = offline.generate([p for p, _ in CASES], [sp for _, sp in CASES])
    core = EngineCore(EngineArgs())

    async def main() -> dict[int, tuple[list[list[int]], list[str], list[str]]]:
        engine = AsyncEngine(core)
        got: dict[int, tuple[list[list[int]], list[str], list[str]]] = {}

        async def one(i: int, prompt: str, params: SamplingParams) -> None:
            await trio.sleep(0.05 * i)  # arrive while others run
            streamed = [""] * params.n
            async for out in engine.generate(None, params, f"req-{i}", prompt=prompt):
                for choice in out.outputs:
                    streamed[choice.index] += choice.text_delta
            got[i] = ([c.token_ids for c in out.outputs], [c.text for c in out.outputs], streamed)

        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            async with trio.open_nursery() as clients:
                for i, (prompt, params) in enumerate(CASES):
                    clients.start_soon(one, i, prompt, params)
            assert engine.stats().kv_usage == 0.0 and engine.stats().num_running == 0
            nursery.cancel_scope.cancel()
        return got

    got = trio.run(main)
    for i, out in enumerate(want):
        token_ids, texts, streamed = got[i]
        assert token_ids == [c.token_ids for c in out.outputs], CASES[i][0]
        assert texts == [c.text for c in out.outputs]
        assert streamed == texts


def test_refused_prompt_ids_leave_the_engine_serving() -> None:
    """A negative id used to kill the scheduler actor (the detokenizer's OverflowError), one past the vocabulary
    to fail its step: both are a ValueError for that request, and the engine goes on serving others."""
    core = EngineCore(EngineArgs())
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM().generate(["The ocean is"], greedy)[0].outputs[0].token_ids

    async def main() -> list[int]:
        engine = AsyncEngine(core)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            for i, bad in enumerate((-3, core.model_config.vocab_size + 5)):
                try:
                    async for _ in engine.generate([1, 2, bad], greedy, f"bad-{i}"):
                        pass
                except ValueError as exc:
                    assert "outside the vocabulary" in str(exc)
                else:
                    raise AssertionError(f"prompt id {bad} was accepted")
            async for out in engine.generate(None, greedy, "good", prompt="The ocean is"):
                last = out
            assert engine.stats().num_running == 0 and engine.stats().kv_usage == 0.0
            nursery.cancel_scope.cancel()
        return list(last.outputs[0].token_ids)

    assert trio.run(main) == list(want)


def test_a_reused_request_id_is_refused_without_touching_the_live_request() -> None:
    """The second request with a live request's id is refused; the first keeps its stream and finishes."""
    core = EngineCore(EngineArgs())
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def main() -> tuple[str | None, int, str]:
        engine = AsyncEngine(core)
        first: list = []
        with trio.fail_after(120):  # before the fix the first stream never ended
            return await run_both(engine, first)

    async def run_both(engine: AsyncEngine, first: list) -> tuple[str | None, int, str]:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)

            async def consume() -> None:
                async for out in engine.generate(None, params, "dup", prompt="Tell me a story"):
                    first.append(out)

            async with trio.open_nursery() as clients:
                clients.start_soon(consume)
                while not first:
                    await trio.sleep(0.01)
                error = ""
                try:
                    async for _ in engine.generate(None, params, "dup", prompt="Other"):
                        pass
                except ValueError as exc:
                    error = str(exc)
            nursery.cancel_scope.cancel()
        final = first[-1].outputs[0]
        return final.finish_reason, len(final.token_ids), error

    reason, n_tokens, error = trio.run(main)
    assert "already in use" in error
    assert (reason, n_tokens) == ("length", 30)


def test_an_abort_right_after_submit_is_not_lost() -> None:
    """A client that leaves right after submitting: its Abort must reach the scheduler after the request does
    (both go through the intake), or the request runs on to max_tokens with no one reading it."""
    core = EngineCore(EngineArgs())
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)

    async def main() -> bool:
        engine = AsyncEngine(core)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)

            short = SamplingParams(temperature=0, max_tokens=2)

            async def filler(i: int) -> None:
                async for _ in engine.generate(None, short, f"filler-{i}", prompt=f"Count to {i}:"):
                    pass

            async def leave_early(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    async for _ in engine.generate(None, params, "victim", prompt="Once upon a time"):
                        pass

            async with trio.open_nursery() as clients:
                for i in range(20):  # queued in the intake ahead of the victim's Submit
                    clients.start_soon(filler, i)
                victim = await clients.start(leave_early)
                await trio.sleep(0)  # it has submitted
                victim.cancel()
            await trio.sleep(1)  # the Submit and the Abort reach the scheduler, in some order
            with trio.move_on_after(10):
                while core.scheduler.has_unfinished_requests() or core.scheduler.kv.usage != 0.0:
                    await trio.sleep(0.05)
            idle = not core.scheduler.has_unfinished_requests()
            nursery.cancel_scope.cancel()
        return idle

    assert trio.run(main), "the aborted request is still running"
