"""vLLM's beam search (``LLM.beam_search``; ``use_beam_search`` on the server), in vLLM's shape and scoring.

A search keeps ``beam_width`` sequences. Each step every live beam runs as a one-token request asking for the raw
logprobs of its ``2 * beam_width`` most likely next tokens; every (beam, candidate) pair is scored and the best
``beam_width`` go on. A candidate that is a stop token completes its beam, which then waits for the end, where
completed and live beams compete for the ``beam_width`` places. The engine's prefix cache holds each beam's
earlier blocks, so a step prefills only the tail of each beam.

The search is a state machine (:class:`BeamSearch`): the offline ``LLM`` and the async server each drive it with
their own request loop and share the search itself.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from candle_vllm.pyengine.outputs import RequestOutput, TokenLogprobs
from candle_vllm.pyengine.sampling.params import MAX_LOGPROBS, SamplingParams

# Each step asks the engine for 2 * beam_width candidates per beam, within the logprobs cap (as vLLM's max_logprobs).
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``. ``temperature`` is that of the one-token requests, which decides the sampled
    token that joins each beam's candidates (scores are raw logprobs, whatever the temperature; None: the
    engine's default, as the server passes an unset one); ``length_penalty`` divides a sequence's cumulative
    logprob by its length (prompt included) to that power."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float | None = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}] (each step asks for "
                             f"2 * beam_width logprobs, at most {MAX_LOGPROBS}), got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """vLLM's: ``tokens`` holds the prompt and the generated tokens, a final stop token included; ``logprobs`` one
    entry per generated token (the candidates its step offered). ``text`` is filled by the caller."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """vLLM's: the best ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: Sequence[int], cum_logprob: float, stop_token_ids: Collection[int],
               length_penalty: float) -> float:
    """vLLM's score: the cumulative logprob over the sequence's length (prompt included, a final stop token
    not) to the power ``length_penalty``."""
    length = len(tokens) - (1 if tokens and tokens[-1] in stop_token_ids else 0)
    return cum_logprob / (length**length_penalty)


class BeamSearch:
    """One prompt's search. Drive it as: while not :attr:`done`, run each of :meth:`beam_prompts` with
    :attr:`step_params` and pass each request's one logprobs entry to :meth:`advance`; then :meth:`best`."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams, stop_token_ids: Collection[int]):
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.stop_token_ids = frozenset(() if params.ignore_eos else stop_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0
        self.step_params = SamplingParams(max_tokens=1, temperature=params.temperature, ignore_eos=True,
                                          logprobs=2 * params.beam_width)

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def beam_prompts(self) -> list[list[int]]:
        """The token ids each live beam runs as this step's prompt."""
        return [beam.tokens for beam in self.beams]

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq.tokens, seq.cum_logprob, self.stop_token_ids, self.params.length_penalty)

    def advance(self, entries: Sequence[TokenLogprobs]) -> None:
        """Extend each live beam (in :meth:`beam_prompts` order) by each candidate of its entry; keep the best."""
        candidates = []
        for beam, entry in zip(self.beams, entries, strict=True):
            for token, lp in entry.items():
                seq = BeamSearchSequence([*beam.tokens, token], [*beam.logprobs, entry], beam.cum_logprob + lp.logprob)
                if token in self.stop_token_ids:
                    seq.finish_reason, seq.stop_reason = "stop", token
                    self.completed.append(seq)
                else:
                    candidates.append(seq)
        candidates.sort(key=self._score, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.steps += 1

    def best(self) -> BeamSearchOutput:
        """The best ``beam_width`` of the completed and the live sequences, best first (texts not filled)."""
        for beam in self.beams:
            beam.finish_reason = "length"
        return BeamSearchOutput(sorted([*self.completed, *self.beams], key=self._score,
                                       reverse=True)[: self.params.beam_width])

    def shown_tokens(self, seq: BeamSearchSequence) -> list[int]:
        """The generated tokens whose text a server response shows: a final stop token only with
        ``include_stop_str_in_output`` (vLLM's server leaves it out of the text, as of any sampled output)."""
        end = len(seq.tokens)
        if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            end -= 1
        return seq.tokens[self.prompt_len : end]


def first_token_logprobs(out: RequestOutput) -> TokenLogprobs:
    """The logprobs entry of a one-token request's token (a beam search step's candidates)."""
    entries = out.outputs[0].logprobs if out.outputs else None
    if not entries:
        raise RuntimeError(f"request {out.request_id} finished without the logprobs of its token")
    return entries[0]
