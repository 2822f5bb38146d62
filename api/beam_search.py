"""vLLM's ``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``: ``n`` is the beam width and the
``n`` best beams are the choices, best first.

Each step of the search (``pyengine.beam_search``) runs the live beams as one-token requests through the same
admission as any request. The search takes ``n``, ``max_tokens``, ``temperature``, ``length_penalty``,
``ignore_eos``, ``include_stop_str_in_output`` and ``skip_special_tokens``; any other sampling field set to a
non-default value is refused with a 400 naming it (vLLM ignores them), and so is ``stream`` (the choices are only
known at the end).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio

from candle_vllm.api.errors import bad_request, service_unavailable
from candle_vllm.api.generation import EngineRequest, start_batch
from candle_vllm.api.prompts import refuse_unbuilt_extras
from candle_vllm.api.routes.common import admit, collect
from candle_vllm.api.schemas import SamplingFields
from candle_vllm.api.state import ServerState
from candle_vllm.pyengine.beam_search import BeamSearch, BeamSearchParams, first_token_logprobs
from candle_vllm.pyengine.outputs import CompletionOutput, RequestOutput
from candle_vllm.pyengine.tokenizer import IncrementalDetokenizer

# Request fields that mean the same with beam search: what it takes, the prompt and how it is rendered, the output's
# shape. Any other field must keep its default.
_TAKEN = frozenset({
    "model", "n", "best_of", "temperature", "max_tokens", "max_completion_tokens", "ignore_eos", "length_penalty",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "use_beam_search", "truncate_prompt_tokens", "user",
    "prompt", "messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "enable_thinking", "thinking", "echo", "return_tokens_as_token_ids", "return_token_ids",
    "add_special_tokens", "tool_choice", "parallel_tool_calls",
})


def beam_search_params(req: SamplingFields, max_tokens: int) -> BeamSearchParams:
    """The request as ``BeamSearchParams``, or a 400 for a field the search cannot honour."""
    if req.stream:
        raise bad_request("use_beam_search cannot stream: the beams are only ranked at the end; send stream false",
                          param="stream")
    for name, spec in type(req).model_fields.items():
        if name not in _TAKEN and name != "stream" and getattr(req, name) != spec.get_default(call_default_factory=True):
            raise bad_request(f"{name} cannot be combined with use_beam_search (beam search takes n, max_tokens, "
                              "temperature, length_penalty, ignore_eos and include_stop_str_in_output)", param=name)
    if getattr(req, "echo", False) and "prompt" in type(req).model_fields:
        raise bad_request("echo cannot be combined with use_beam_search on /v1/completions", param="echo")
    refuse_unbuilt_extras(req)
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                temperature=req.temperature,
                                length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as exc:
        param = "n" if str(exc).startswith("beam_width") else None
        raise bad_request(str(exc).replace("beam_width", "n (the beam width)", 1), param=param) from None


class BeamSearchRun:
    """The beam searches of one HTTP request, which the server tracks as one request in flight: a drain waits for
    the whole search (not just the step running), and admission is checked once, before its first step."""

    def __init__(self, state: ServerState, request_id: str) -> None:
        self.state = state
        self.request_id = request_id
        self.scope = trio.CancelScope()

    def abort(self) -> None:
        self.scope.cancel()

    async def run(self, prompts: list[list[int]], params: list[BeamSearchParams]) -> list[BeamSearch]:
        """Search from every prompt at once: each step runs the live beams of every prompt as one batch."""
        admit(self.state)
        stop_ids = self.state.engine.tokenizer.stop_token_ids
        searches = [BeamSearch(ids, p, stop_ids) for ids, p in zip(prompts, params, strict=True)]
        self.state.track(self)
        try:
            with self.scope:
                while live := [s for s in searches if not s.done]:
                    await self._step(live)
        finally:
            self.state.forget(self)
        if self.scope.cancelled_caught:
            raise service_unavailable("the server is shutting down; the beam search was stopped, retry on another "
                                      "replica", retry_after_s=5)
        return searches

    async def _step(self, live: list[BeamSearch]) -> None:
        step = live[0].steps
        requests = [EngineRequest(f"{self.request_id}-step{step}-{i}-{j}", beam, search.step_params)
                    for i, search in enumerate(live) for j, beam in enumerate(search.beam_prompts())]
        batch = start_batch(self.state, requests)
        try:
            last = iter(await collect(batch.outputs(), len(requests)))
        finally:
            await batch.close()
        for search in live:
            outs = [next(last) for _ in search.beams]
            if any(out is None or not out.finished for out in outs):  # the drain ended the step's requests
                self.scope.cancel()
                return
            search.advance([first_token_logprobs(out) for out in outs if out is not None])


def beam_outputs(search: BeamSearch, request_id: str, prompt: str | None, tokenizer: Any,
                 skip_special_tokens: bool) -> tuple[RequestOutput, list[list[int]]]:
    """The best beams of a finished search as the choices of one ``RequestOutput``, with the tokens each choice
    shows. Token ids are as vLLM's server gives them (a final stop token included); the text is the shown
    tokens decoded (:meth:`BeamSearch.shown_tokens`)."""
    best = search.best().sequences
    shown = [search.shown_tokens(seq) for seq in best]
    choices = []
    for i, (seq, ids) in enumerate(zip(best, shown, strict=True)):
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        tokens = seq.tokens[search.prompt_len:]
        choices.append(CompletionOutput(index=i, text=text, token_ids=tokens, finish_reason=seq.finish_reason,
                                        stop_reason=seq.stop_reason, text_delta=text, token_ids_delta=tokens,
                                        cumulative_logprob=seq.cum_logprob))
    return RequestOutput(request_id, prompt, search.prompt_token_ids, choices, finished=True), shown


async def token_by_token(out: RequestOutput, shown: list[list[int]], tokenizer: Any, skip_special_tokens: bool,
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The beams as the engine would have streamed them: an output per token, each choice's text growing by
    incremental detokenization, so the chat pipeline splits reasoning, counts its tokens and parses tool calls
    as it does for sampled output."""
    detoks = [IncrementalDetokenizer(tokenizer, out.prompt_token_ids, skip_special_tokens) for _ in out.outputs]
    for k in range(max(len(c.token_ids) for c in out.outputs)):
        step = []
        for c, detok, ids in zip(out.outputs, detoks, shown, strict=True):
            if k >= len(c.token_ids):
                continue
            delta = detok.push(ids[k]) if k < len(ids) else ""
            last = k == len(c.token_ids) - 1
            step.append(CompletionOutput(index=c.index, token_ids=c.token_ids[: k + 1], text_delta=delta,
                                         token_ids_delta=[c.token_ids[k]],
                                         finish_reason=c.finish_reason if last else None,
                                         stop_reason=c.stop_reason if last else None,
                                         cumulative_logprob=c.cumulative_logprob if last else None))
        yield 0, RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, step, finished=False)
    yield 0, out  # every choice whole, for the usage
