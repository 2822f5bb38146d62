"""The Responses API's request (``POST /v1/responses``) read as the chat request it amounts to.

``input`` (text, or items: messages with text parts, ``function_call`` and ``function_call_output``) and
``instructions`` become chat messages; flat function ``tools``, ``tool_choice``, ``text.format``,
``max_output_tokens``, ``temperature``, ``top_p`` and ``reasoning.effort`` map onto chat's fields. What this
server cannot do is refused with a 400 naming it: stored responses (``previous_response_id``, ``conversation``,
``background``), built-in tools, images and files, ``include``d extras, logprobs. ``store`` is answered ``false``
in the response, as vLLM answers it when it keeps no store.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from candle_vllm.api.errors import bad_request
from candle_vllm.api.schemas import ChatCompletionRequest, parse_request

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Request fields that would need state or features this server does not have, with why (a value that changes
# nothing -- None, False, an empty list -- is accepted).
_REFUSED = {
    "previous_response_id": "responses are not stored; send the whole conversation in input",
    "conversation": "conversations are not stored; send the whole conversation in input",
    "background": "background responses are not supported; wait for the response or stream it",
    "include": "include is not supported (no logprobs, encrypted reasoning or tool sources to add)",
    "top_logprobs": "top_logprobs is not supported on /v1/responses; use /v1/chat/completions with logprobs",
    "prompt": "stored prompt templates are not supported; send the prompt in input",
    "max_tool_calls": "max_tool_calls is not supported",
    "context_management": "context_management is not supported; the input must fit the context",
}
# vLLM's sampling extras, taken as on chat; any other field outside the Responses API's is a 400 (chat's own
# fields -- n, logprobs, echo, messages... -- would be taken and then lost in the one-message answer).
_SAMPLING_EXTRAS = frozenset({
    "seed", "top_k", "min_p", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "chat_template_kwargs",
    "priority",
})
# Fields that change nothing here (routing, caching and safety hints of OpenAI's service).
_NO_EFFECT = frozenset({"service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                        "stream_options"})
# Chat's names for the Responses fields they come from, for the 400s the chat checks raise.
_PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format"}


class ResponsesRequest(BaseModel):
    """The fields read here; the rest of the body is checked against ``_REFUSED`` and otherwise passed through
    to the chat request (``seed``, ``top_k``, ``stop``... as vLLM's Responses API takes them)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None (the SDK may send it): true
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be text or a list of text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(f"{where}.content[{j}] is a {kind!r} part; only text parts (input_text, output_text) "
                              "are supported", param=f"{where}.content")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)  # as chat joins text parts (vLLM's rule)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages; consecutive function calls form one assistant turn."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message" and item.get("role") in _ROLES:
            messages.append({"role": _ROLES[item["role"]], "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: chat templates leave it out of the prompt
        else:
            raise bad_request(f"{where} is a {kind!r} item with role {item.get('role')!r}; supported: messages "
                              "(user, system, developer, assistant), function_call, function_call_output, reasoning",
                              param=where)
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}] is a {tool.get('type')!r} tool; only function tools are supported",
                              param=f"tools[{i}].type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if k in tool}})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(f"tool_choice {choice.get('type')!r} is not supported; name a function",
                              param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise bad_request(f"text.format {kind!r} is not supported (text, json_object or json_schema)",
                      param="text.format.type")


def responses_param(param: str | None) -> str | None:
    """A chat field named in a 400 as the Responses field it came from."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    if head == "messages":  # instructions and merged calls shift the turns: name the input as a whole
        return "input"
    return _PARAM_NAMES.get(head, head) + dot + rest


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request amounts to (400s for what cannot be honoured)."""
    extra = dict(req.model_extra or {})
    for name, why in _REFUSED.items():
        value = extra.pop(name, None)
        if value not in (None, False, [], {}, ""):
            raise bad_request(why, param=name)
    for name in list(extra):
        if name in _NO_EFFECT:
            del extra[name]
        elif name not in _SAMPLING_EXTRAS:
            raise bad_request(f"{name} is not a field of the Responses API (nor one of vLLM's sampling extras it "
                              "takes)", param=name)
    for name in ("summary", "generate_summary"):
        if (req.reasoning or {}).get(name) is not None:
            raise bad_request("reasoning summaries are not supported: reasoning comes back whole as a reasoning "
                              "item's content", param=f"reasoning.{name}")
    if (req.text or {}).get("verbosity") is not None:
        raise bad_request("text.verbosity is not supported", param="text.verbosity")
    if req.truncation not in (None, "disabled"):
        raise bad_request("truncation 'auto' is not supported; the input must fit the context", param="truncation")
    body: dict[str, Any] = {**extra, "model": req.model, "messages": _messages(req), "stream": bool(req.stream),
                            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
                            "parallel_tool_calls": req.parallel_tool_calls is not False, "response_format": _response_format(req.text),
                            "user": req.user}
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["chat_template_kwargs"] = {**body.get("chat_template_kwargs", {}), "reasoning_effort": effort}
        if effort == "none":
            body["enable_thinking"] = False
    return parse_request(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})
