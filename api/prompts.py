"""From a validated request to what the engine takes: prompt token ids and ``SamplingParams``.

Every check a client can fail happens here, before the engine sees the request, and fails as a 400 that names
the parameter: template errors, unsupported content, token ids outside the vocabulary (and, in ``limits``,
prompts that with the requested ``max_tokens`` do not fit the model's context or KV cache).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from candle_vllm.api.errors import bad_request
from candle_vllm.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
    SamplingFields,
    TokenizeRequest,
    validation_error,
)
from candle_vllm.pyengine.sampling.params import SamplingParams, StructuredOutputParams, truncate_prompt
from candle_vllm.pyengine.structured_output import check_structured_output

log = logging.getLogger(__name__)


def _message_dict(msg: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates expect it (vLLM's preprocessing): text parts joined into one string,
    tool-call arguments as dicts, reasoning under both names clients use."""
    out = {k: v for k, v in msg.model_dump().items() if v is not None or k == "content"}
    content = msg.content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type")
            if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise bad_request(f"messages[{index}]: content part type {kind!r} is not supported by this model; "
                                  "send text parts only", param=f"messages.{index}.content")
        out["content"] = "\n".join(texts)
    calls = out.get("tool_calls")
    if calls == [] or calls is None:
        out.pop("tool_calls", None)
    elif isinstance(calls, list):
        out["tool_calls"] = [_parse_arguments(c) for c in calls]
    reasoning = out.get("reasoning_content", out.get("reasoning"))
    if reasoning is not None:
        out["reasoning_content"] = out["reasoning"] = reasoning
    return out


def _parse_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return call
        if isinstance(args, dict):
            return {**call, "function": {**fn, "arguments": args}}
    return call


def requested_template(tokenizer: Any, req: ChatCompletionRequest | TokenizeRequest, trusted: bool) -> str | None:
    """The chat template a request asks for: ``chat_template``, or ``chat_template_kwargs.chat_template`` (which
    vLLM and transformers also read as the template); None for the model's default.

    A name of one of the model's own templates is always fine. A template brought by the request is Jinja run
    on the server, where a loop of a few lines can take hours, so it is refused (400 naming the field) unless
    the server runs with ``--trust-request-chat-template`` (vLLM's flag and default)."""
    given = {"chat_template": req.chat_template,
             "chat_template_kwargs": (req.chat_template_kwargs or {}).get("chat_template")}
    given = {param: value for param, value in given.items() if value is not None}
    if not given:
        return None
    param, template = next(iter(given.items()))
    if len(given) == 2 and given["chat_template"] != given["chat_template_kwargs"]:
        raise bad_request("chat_template and chat_template_kwargs.chat_template differ; give the template once",
                          param="chat_template_kwargs")
    field = "chat_template" if param == "chat_template" else "chat_template_kwargs.chat_template"
    if not isinstance(template, str):  # only chat_template_kwargs can hold another type
        raise bad_request(f"{field} must be a string", param=param)
    if template in tokenizer.chat_templates or trusted:
        return template
    names = ", ".join(sorted(tokenizer.chat_templates)) or "none"
    raise bad_request(f"{field} sends a chat template, but this server renders only the model's own templates "
                      f"(by name: {names}); start the server with --trust-request-chat-template to accept "
                      "templates sent with requests", param=param)


def render_chat(tokenizer: Any, req: ChatCompletionRequest | TokenizeRequest, tools: list[dict[str, Any]] | None,
                thinking: bool | None = None, *, trust_template: bool = False) -> str:
    """The prompt text of a chat request, rendered by the model's chat template (errors are 400s).

    ``tools`` are the ones the prompt offers (none for ``tool_choice: "none"``); ``thinking`` (the request's
    reasoning switch) reaches templates as ``enable_thinking`` (Qwen3) and ``thinking`` (DeepSeek-V3.1).
    ``trust_template`` (``--trust-request-chat-template``) lets the request bring its own template.
    CPU-heavy: routes call it in a worker thread (see ``routes.common.in_worker``)."""
    template = requested_template(tokenizer, req, trust_template)
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages or [])]
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "chat_template"}
    if thinking is not None:
        kwargs = {"enable_thinking": thinking, "thinking": thinking, **kwargs}
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=kwargs or None, chat_template=template, documents=req.documents,
            continue_final_message=req.continue_final_message)
    except Exception as exc:  # jinja errors, raise_exception() in templates, templates missing
        log.info("chat template failed: %s", exc)
        raise bad_request(f"the chat template could not be rendered: {exc}", param="messages") from None


def structured_output_params(req: SamplingFields) -> StructuredOutputParams | None:
    """``response_format`` (json_object / json_schema, chat and completions) or vLLM's ``guided_json`` as the
    engine's structured-output params. A schema the grammar library cannot use is a 400 naming the field."""
    extra = req.model_extra or {}
    fmt = getattr(req, "response_format", None)
    if fmt is not None and not isinstance(fmt, ResponseFormat):  # completions keep it as an extra field
        try:
            fmt = ResponseFormat.model_validate(fmt)
        except ValidationError as exc:
            raise bad_request(f"response_format: {validation_error(exc).message}", param="response_format") from None
    params, param = None, "response_format"
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        raise bad_request(f"response_format.json_schema is only read with type 'json_schema', not {fmt.type!r}",
                          param="response_format")
    if fmt is not None and fmt.type == "json_object":
        params = StructuredOutputParams(json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format type 'json_schema' needs json_schema.schema, a JSON Schema object",
                              param="response_format")
        params = StructuredOutputParams(json_schema=schema)
    guided = extra.get("guided_json")
    if guided is not None:
        if params is not None:
            raise bad_request("give response_format or guided_json, not both", param="guided_json")
        if isinstance(guided, str):
            try:
                guided = json.loads(guided)
            except ValueError:
                raise bad_request("guided_json is not valid JSON", param="guided_json") from None
        if not isinstance(guided, dict):
            raise bad_request("guided_json must be a JSON Schema object", param="guided_json")
        params, param = StructuredOutputParams(json_schema=guided), "guided_json"
    if params is not None:
        try:
            check_structured_output(params, None)
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None
    return params


def truncated_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt cut to its last ``truncate_prompt_tokens`` tokens before any length check (vLLM's order), a 400
    for a value the model cannot take."""
    try:
        return truncate_prompt(ids, keep, max_model_len)
    except ValueError as e:
        raise bad_request(str(e), param="truncate_prompt_tokens") from None


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})", param=param)


# vLLM's request extras that would change the output and are not built, with the value that changes nothing (a
# client may send that; a frozenset: any of its values): refused with a 400 naming the field instead of being kept
# and ignored.
UnbuiltExtras = Mapping[str, tuple[Any, str]]
_UNBUILT_EXTRAS: UnbuiltExtras = {
    "logits_processors": (None, "logits_processors are not supported"),
    **{name: (None, f"{name} is not supported; constrain the output with response_format (json_schema or "
                    "json_object) or guided_json")
       for name in ("guided_regex", "guided_choice", "guided_grammar", "structural_tag", "structured_outputs")},
}


def refuse_unbuilt_extras(req: BaseModel, extras: UnbuiltExtras = _UNBUILT_EXTRAS) -> None:
    """A 400 for any field of ``extras`` (by default the sampling routes' ones) the request sets to a value that
    would change the output (empty lists and nulls change nothing)."""
    extra = req.model_extra or {}
    for name, (neutral, why) in extras.items():
        value = extra.get(name)
        changes_nothing = value in neutral if isinstance(neutral, frozenset) else value == neutral
        if value is not None and not changes_nothing and value != []:
            raise bad_request(why, param=name)


def sampling_params(req: SamplingFields, max_tokens: int | None, vocab_size: int, *, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's sampling fields as ``SamplingParams`` (unset fields stay unset for server defaults)."""
    refuse_unbuilt_extras(req)
    if req.length_penalty != 1.0:
        raise bad_request("length_penalty applies to beam search only; set use_beam_search true or leave it at 1",
                          param="length_penalty")
    try:
        params = SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, stop=req.stop_list(),
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_output=structured_output_params(req),
        )
        params.check_vocab(vocab_size)
    except ValueError as exc:  # SamplingParams' messages start with the field they are about
        first = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param=first if first in type(req).model_fields else None) from None
    return params
