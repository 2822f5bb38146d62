"""A scripted stand-in for contract G's ``AsyncEngine`` (real tokenizer, no model) for HTTP-layer tests.

It makes wire-format and lifecycle tests fast and deterministic: each choice emits ``max_tokens`` (default 6)
tokens chosen from the prompt, with made-up but well-formed logprobs, one token per ``delay_s``; an embedding
request gets a unit vector made from its prompt. It is never used to judge generation quality; the end-to-end
tests run the real engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio

from candle_vllm.pyengine.loader.pooling import Matryoshka
from candle_vllm.pyengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from candle_vllm.pyengine.tokenizer import IncrementalDetokenizer, Tokenizer

DEFAULT_MAX_TOKENS = 6
WORDS = ["", "the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "far", "away"]


@dataclass
class FakeModelConfig:
    hidden_size: int = 16


@dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    kv_usage: float


class FakeEngine:
    """Implements ``generate``/``abort``/``stats`` and the attributes the HTTP layer reads."""

    def __init__(self, tokenizer: Tokenizer, *, delay_s: float = 0.0, max_model_len: int = 512,
                 reject_prompts_longer_than: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.model_config = FakeModelConfig()
        self.matryoshka = Matryoshka()  # trained for no truncated sizes: ``dimensions`` is refused
        self.max_model_len = max_model_len
        self.delay_s = delay_s
        self.reject_over = reject_prompts_longer_than
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.seen_params: list[Any] = []
        self.seen_prompts: list[list[int]] = []
        self.seen_priorities: list[int] = []
        self._vocab = [tokenizer.encode(w, add_special_tokens=False)[0] for w in WORDS if w]

    def stats(self) -> FakeStats:
        return FakeStats(len(self.running), 0, 0.01 * len(self.running))

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.discard(request_id)

    def _token(self, prompt: list[int], step: int, choice: int) -> int:
        return self._vocab[(sum(prompt) + 3 * step + 5 * choice) % len(self._vocab)]

    def _logprobs(self, chosen: int, k: int) -> dict[int, Logprob]:
        cands = [chosen, *[t for t in self._vocab if t != chosen][:k]]
        scores = [2.0 - 0.5 * i for i in range(len(cands))]
        norm = math.log(sum(math.exp(s) for s in scores))
        return {t: Logprob(s - norm, rank=i + 1, decoded_token=self.tokenizer.id_to_piece(t))
                for i, (t, s) in enumerate(zip(cands, scores, strict=True))}

    async def generate(self, prompt_token_ids: list[int], params: Any, request_id: str,
                       prompt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        if self.reject_over is not None and len(prompt_token_ids) > self.reject_over:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens can never fit; raise --kv-fraction or --mem")
        self.seen_params.append(params)
        self.seen_priorities.append(priority)
        self.seen_prompts.append(list(prompt_token_ids))
        self.running.add(request_id)
        metrics = RequestMetrics()
        max_tokens = params.max_tokens or DEFAULT_MAX_TOKENS
        choices = [CompletionOutput(index=j, logprobs=[] if params.logprobs is not None else None)
                   for j in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_token_ids) for _ in choices]
        prompt_lp = None
        if params.prompt_logprobs is not None:
            prompt_lp = [None] + [self._logprobs(t, params.prompt_logprobs) for t in prompt_token_ids[1:]]
        metrics.first_scheduled_time = time.monotonic()
        if params.embed:  # a unit vector made from the prompt, and no tokens
            raw = [math.cos(sum(prompt_token_ids) + i) for i in range(self.model_config.hidden_size)]
            norm = math.sqrt(sum(x * x for x in raw))
            yield RequestOutput(request_id, prompt, list(prompt_token_ids), [CompletionOutput(0, finish_reason="stop")],
                                finished=True, embedding=[x / norm for x in raw], metrics=metrics)
            return
        try:
            for step in range(max_tokens):
                await trio.sleep(self.delay_s)
                if request_id not in self.running:
                    return
                now = time.monotonic()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                for c, detok in zip(choices, detoks, strict=True):
                    tok = self._token(prompt_token_ids, step, c.index)
                    c.text_delta = detok.push(tok)
                    c.text += c.text_delta
                    c.token_ids_delta = [tok]
                    c.token_ids.append(tok)
                    if c.logprobs is not None:
                        c.logprobs_delta = [self._logprobs(tok, params.logprobs)]
                        c.logprobs.extend(c.logprobs_delta)
                    if step == max_tokens - 1:
                        c.finish_reason = "length"
                done = step == max_tokens - 1
                if done:
                    metrics.finished_time = now
                yield RequestOutput(request_id, prompt, list(prompt_token_ids), [_copy(c) for c in choices],
                                    finished=done, num_cached_tokens=0, prompt_logprobs=prompt_lp,
                                    metrics=metrics)
        finally:
            self.running.discard(request_id)


def _copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), None if c.logprobs is None else list(c.logprobs),
                            c.finish_reason, c.stop_reason, c.text_delta, list(c.token_ids_delta),
                            None if c.logprobs_delta is None else list(c.logprobs_delta))
