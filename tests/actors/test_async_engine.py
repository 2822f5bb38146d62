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
