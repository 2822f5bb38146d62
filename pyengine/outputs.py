"""What the engine hands back per request: vLLM's output shapes (contract G), so users' code ports unchanged
and the HTTP layer can stream deltas without re-diffing cumulative text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token at one position, with its rank in the model's distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class PromptLogprobsChunk:
    """The prompt logprobs one prefill chunk produced: ``entries[j]`` is prompt token ``first_position + j``'s
    (None for token 0, which nothing predicts). A chunk recomputed after a preemption repeats positions the
    output already holds; the position says which."""

    first_position: int
    entries: list[TokenLogprobs | None]


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request (``n > 1`` gives several); cumulative fields plus the delta since the last yield."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprobs] | None = None
    # vLLM's field: the sum of the chosen tokens' logprobs, None unless ``logprobs`` was asked for (as vLLM v1's
    # LogprobsProcessor); users rank n > 1 choices by it. Last, so positional constructions keep their meaning.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock milestones of a request (``time.monotonic()`` seconds) for TTFT / ITL / queue metrics."""

    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of a request as the engine reports it; the last one for a request has ``finished=True``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Embedding requests (SamplingParams.embed): the last prompt token's final hidden state, L2-normalised.
    embedding: list[float] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: one prompt's vector."""

    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput`` (``LLM.embed``): the prompt's ids and its vector in ``outputs``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
