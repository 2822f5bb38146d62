"""Output processing: engine tokens -> text deltas, stop strings and ``RequestOutput`` objects.

A user request with ``n`` choices runs as ``n`` engine requests (one ``Request`` each, sharing the prompt's
KV blocks); this module folds them back into one ``RequestOutput``. It never reads scheduler state: each step
hands it ``TokenEvent``s (token, and the finish state the scheduler decided right after that token), so it can
run in another task, a step behind the scheduler. Stop strings found here must end the engine request in the
scheduler (``StopStringHit``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from candle_vllm.pyengine.outputs import (
    CompletionOutput,
    PromptLogprobsChunk,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from candle_vllm.pyengine.request import Request
from candle_vllm.pyengine.sampling import SamplingParams
from candle_vllm.pyengine.stop_strings import StopStringMatcher
from candle_vllm.pyengine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class TokenEvent:
    """One token an engine request kept in a step, and its state right after it."""

    request_id: str
    token_id: int
    finish_reason: str | None = None  # "stop" | "length" set when this token ended the request
    stop_reason: int | None = None  # the stop token id (None for the model's own EOS)
    logprobs: TokenLogprobs | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # when the scheduler first admitted the engine request


@dataclass(slots=True)
class _Choice:
    request_id: str
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    emitted: int = 0  # characters of stops.text already reported


@dataclass(slots=True)
class RequestGroup:
    """One user request: its prompt, parameters and the engine requests of its choices."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def finished(self) -> bool:
        return all(c.output.finish_reason is not None for c in self.choices)


@dataclass(slots=True)
class StopStringHit:
    """A stop string ended an engine request: the scheduler must finish it."""

    request_id: str
    stop: str


class OutputProcessor:
    """Keeps per-request text state and builds the engine's outputs after each step."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self._group_of: dict[str, RequestGroup] = {}  # engine request id -> its group

    def add(self, group: RequestGroup, requests: list[Request]) -> None:
        """Register a user request and the engine requests of its choices (index order)."""
        params = group.params
        for index, req in enumerate(requests):
            detok = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, params.skip_special_tokens)
            stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
            wants = params.logprobs is not None
            output = CompletionOutput(index=index, logprobs=[] if wants else None,
                                      cumulative_logprob=0.0 if wants else None)
            group.choices.append(_Choice(req.request_id, output, detok, stops))
            self._group_of[req.request_id] = group
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = []
        self.groups[group.request_id] = group

    def engine_request_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [c.request_id for c in group.choices] if group else []

    def group_id(self, engine_request_id: str) -> str | None:
        """The user request an engine request belongs to."""
        group = self._group_of.get(engine_request_id)
        return group.request_id if group else None

    def add_prompt_logprobs(self, engine_request_id: str, chunk: PromptLogprobsChunk) -> None:
        """Prompt logprobs of a prefill chunk (only the first choice's are kept: all choices share the prompt).
        The positions already held (a chunk recomputed after a preemption) are not added again."""
        group = self._group_of.get(engine_request_id)
        if group is None or group.prompt_logprobs is None or group.choices[0].request_id != engine_request_id:
            return
        held = len(group.prompt_logprobs)
        if chunk.first_position > held:
            raise ValueError(f"prompt logprobs of {engine_request_id!r} from position {chunk.first_position}, but "
                             f"only {held} are held: positions were skipped")
        new = chunk.entries[held - chunk.first_position:]
        if group.params.detokenize:
            self._decode_logprobs(new)
        group.prompt_logprobs.extend(new)

    def add_embedding(self, engine_request_id: str, vector: list[float]) -> None:
        """The embedding of an embedding request, which arrives with (and before) the step's token events."""
        group = self._group_of.get(engine_request_id)
        if group is not None:
            group.embedding = vector

    def process(self, events: list[TokenEvent]) -> tuple[list[RequestOutput], list[StopStringHit]]:
        """Turn a step's token events into outputs (one per user request that changed); finished user
        requests are forgotten. Events of requests that already ended (an abort, a stop string) are ignored."""
        now = time.monotonic()
        hits: list[StopStringHit] = []
        changed: dict[str, RequestGroup] = {}
        for event in events:
            group = self._group_of.get(event.request_id)
            if group is None:
                continue
            choice = next(c for c in group.choices if c.request_id == event.request_id)
            if choice.output.finish_reason is not None:
                continue
            group.num_cached_tokens = max(group.num_cached_tokens, event.num_cached_tokens)
            hit = self._advance(choice, event, group.params)
            if hit is not None:
                hits.append(hit)
            changed[group.request_id] = group
            scheduled, known = event.first_scheduled_time, group.metrics.first_scheduled_time
            if scheduled is not None and (known is None or scheduled < known):
                group.metrics.first_scheduled_time = scheduled  # the earliest of its choices
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.metrics.last_token_time = now
        outputs = [self._snapshot(group, now) for group in changed.values()]
        return outputs, hits

    def _advance(self, choice: _Choice, event: TokenEvent, params: SamplingParams) -> StopStringHit | None:
        out = choice.output
        if params.embed:  # the one token an embedding request runs only ends it: no text, tokens or usage
            out.finish_reason = "stop"  # as vLLM reports a pooling request, whatever that token was
            return None
        out.token_ids.append(event.token_id)
        out.token_ids_delta.append(event.token_id)
        if event.logprobs is not None and out.logprobs is not None:
            if params.detokenize:
                self._decode_logprobs([event.logprobs])
            out.logprobs.append(event.logprobs)
            out.logprobs_delta = [*(out.logprobs_delta or []), event.logprobs]
            if out.cumulative_logprob is not None:  # the chosen token is always in its entry
                out.cumulative_logprob += event.logprobs[event.token_id].logprob
        hit: StopStringHit | None = None
        stop_token = event.finish_reason == "stop"
        # A stop token's text is not part of the output, except a requested stop id with include_stop_str.
        if not stop_token or (params.include_stop_str_in_output and event.stop_reason is not None):
            # vLLM: text made within the first min_tokens tokens never matches a stop string.
            searchable = len(out.token_ids) > params.min_tokens
            text = choice.detokenizer.push(event.token_id) if params.detokenize else ""  # vLLM: ids only
            match = choice.stops.append(text, searchable)
            if match is not None:
                out.finish_reason, out.stop_reason = "stop", match.stop
                hit = StopStringHit(choice.request_id, match.stop)
        if out.finish_reason is None and event.finish_reason is not None:
            out.finish_reason, out.stop_reason = event.finish_reason, event.stop_reason
            choice.stops.append(choice.detokenizer.flush() if params.detokenize else "")
        end = len(choice.stops.text) if out.finish_reason is not None else choice.stops.safe_length()
        if end > choice.emitted:
            delta = choice.stops.text[choice.emitted : end]
            out.text += delta
            out.text_delta += delta
            choice.emitted = end
        return hit

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished choice of a user request aborted; returns the final output."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for choice in group.choices:
            if choice.output.finish_reason is None:
                choice.output.finish_reason = "abort"
        return self._snapshot(group, time.monotonic())

    def _snapshot(self, group: RequestGroup, now: float) -> RequestOutput:
        outputs = []
        for choice in group.choices:
            out = choice.output
            outputs.append(
                CompletionOutput(
                    index=out.index, text=out.text, token_ids=list(out.token_ids),
                    logprobs=list(out.logprobs) if out.logprobs is not None else None,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason, text_delta=out.text_delta,
                    token_ids_delta=out.token_ids_delta, logprobs_delta=out.logprobs_delta,
                    cumulative_logprob=out.cumulative_logprob,
                )
            )
            out.text_delta, out.token_ids_delta, out.logprobs_delta = "", [], None
        finished = group.finished
        if finished:
            group.metrics.finished_time = now
            del self.groups[group.request_id]
            for choice in group.choices:
                self._group_of.pop(choice.request_id, None)
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=outputs, finished=finished, num_cached_tokens=group.num_cached_tokens,
            prompt_logprobs=group.prompt_logprobs, embedding=group.embedding, metrics=group.metrics,
        )

    def _decode_logprobs(self, entries: list[TokenLogprobs | None]) -> None:
        for entry in entries:
            if entry is None:
                continue
            for token_id, lp in entry.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
