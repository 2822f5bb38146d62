"""vLLM's ``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``: ``n`` is the beam width and the
``n`` best beams are the choices, best first.

Each step of the search (``pyengine.beam_search``) runs the live beams as one-token requests through the same
admission as any request. The search takes ``n``, ``max_tokens``, ``temperature``, ``length_penalty``,
``ignore_eos``, ``include_stop_str_in_output`` and ``skip_special_tokens``; any other sampling field set to a
non-default value is refused with a 400 naming it (vLLM ignores them), and so is ``stream`` (the choices are only
known at the end).
"""

from __future__ import annotations

from typing import Any

from candle_vllm.api.errors import bad_request
from candle_vllm.api.generation import EngineRequest
from candle_vllm.api.prompts import refuse_unbuilt_extras
from candle_vllm.api.routes.common import collect, submit
from candle_vllm.api.schemas import SamplingFields
from candle_vllm.api.state import ServerState
from candle_vllm.pyengine.beam_search import BeamSearch, BeamSearchParams
from candle_vllm.pyengine.llm import first_token_logprobs
from candle_vllm.pyengine.outputs import CompletionOutput, RequestOutput

# Request fields that mean the same with beam search: what it takes, the prompt and how it is rendered, the output's
# shape. Any other field must keep its default.
_TAKEN = frozenset({
    "model", "n", "best_of", "temperature", "max_tokens", "max_completion_tokens", "ignore_eos", "length_penalty",
    "include_stop_str_in_output", "skip_special_tokens", "use_beam_search", "truncate_prompt_tokens", "user",
    "prompt", "messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "enable_thinking", "thinking", "echo", "return_tokens_as_token_ids",
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
                                temperature=1.0 if req.temperature is None else req.temperature,
                                length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as exc:
        param = "n" if str(exc).startswith("beam_width") else None
        raise bad_request(str(exc).replace("beam_width", "n (the beam width)", 1), param=param) from None


async def run_beam_search(state: ServerState, request_id: str, prompt_ids: list[int], prompt: str | None,
                          params: BeamSearchParams, skip_special_tokens: bool) -> RequestOutput:
    """Search from one prompt; the best beams come back as the choices of one finished ``RequestOutput``."""
    tokenizer = state.engine.tokenizer
    search = BeamSearch(prompt_ids, params, tokenizer.stop_token_ids)
    while not search.done:
        requests = [EngineRequest(f"{request_id}-step{search.steps}-beam{i}", beam, search.step_params)
                    for i, beam in enumerate(search.beam_prompts())]
        batch, outputs, _ = await submit(state, requests, stream=False)
        try:
            last = await collect(outputs, len(requests))
        finally:
            await batch.close()
        if any(out is None or not out.finished for out in last):
            raise bad_request("a beam search step was aborted (the server is draining); retry the request")
        search.advance([first_token_logprobs(out) for out in last if out is not None])
    result = search.result(lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens),
                           with_prompt=False)
    choices = []
    for i, seq in enumerate(result.sequences):
        tokens, text = seq.tokens[len(prompt_ids):], seq.text or ""
        choices.append(CompletionOutput(index=i, text=text, token_ids=tokens, finish_reason=seq.finish_reason,
                                        stop_reason=seq.stop_reason, text_delta=text, token_ids_delta=tokens,
                                        cumulative_logprob=seq.cum_logprob))
    return RequestOutput(request_id, prompt, list(prompt_ids), choices, finished=True)


async def one_output(out: RequestOutput) -> Any:
    """``out`` as the ``(request index, output)`` stream the response builders read."""
    yield 0, out
