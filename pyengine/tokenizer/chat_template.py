"""Chat templates rendered the way transformers renders them, so prompts match the model's training.

Templates are untrusted Jinja code from model repositories, so they run in jinja2's immutable sandbox
with exactly the helpers transformers offers (``raise_exception``, ``strftime_now``, a JSON ``tojson``
that keeps non-ASCII and key order, a restricted ``dict`` and ``namespace``, a no-op
``{% generation %}`` tag). Messages get the preprocessing OpenAI-style servers (vLLM) apply before
rendering: tool-call arguments parsed to dicts, reasoning copied under the names templates read,
text parts joined when the template expects string content.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template cannot render this conversation (the server answers 400 with this message)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here a no-op."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API declares it as a class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` for templates without exposing the real type (no attribute access to escape through)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` refusing underscore names, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attr_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attr_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attr_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> tuple[jinja2.Template, bool]:
    """Compiled template and whether it iterates over message content parts (OpenAI list format)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_TemplateNamespace
    )
    try:
        ast = env.parse(template)
        compiled = env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from e
    return compiled, any(_iterates_content(loop.iter) for loop in ast.find_all(jinja2.nodes.For))


def _iterates_content(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        return _iterates_content(node.node)
    return False


def select_chat_template(templates: dict[str, str], requested: str | None, tools: list[Any] | None) -> str:
    """Pick the template to render: ``requested`` (a name or a whole template), else ``tool_use`` when
    tools are given, else ``default`` (transformers' rule)."""
    if requested is not None:
        return templates.get(requested, requested)
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if templates:
        raise ChatTemplateError(
            f"the model has several chat templates and none is named 'default'; choose one of {sorted(templates)}"
        )
    raise ChatTemplateError(
        "the model has no chat template; pass one (--chat-template / chat_template=...) or use /v1/completions"
    )


def _plain(value: Any) -> Any:
    """Plain JSON-like copy of ``value``: templates must not see (or mutate) callers' objects."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _join_text_parts(content: list[Any], role: str) -> str:
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and "text" in part:
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(
                f"a {role} message has a content part of type {kind!r}; this model's chat template accepts "
                "text only"
            )
    return "\n".join(texts)


def prepare_messages(messages: list[dict[str, Any]], wants_parts: bool) -> list[dict[str, Any]]:
    """Messages as templates expect them (see the module docstring); the input is not modified."""
    prepared = []
    for raw in messages:
        if not isinstance(raw, dict):
            raise ChatTemplateError(f"each chat message must be an object, got {type(raw).__name__}")
        # content stays even when null (an assistant turn of tool calls): templates test `content is none`, and
        # transformers passes it as given; the other null fields are dropped.
        message = {k: v for k, v in _plain(raw).items() if v is not None or k == "content"}
        role = str(message.get("role", ""))
        if isinstance(message.get("content"), list) and not wants_parts:
            message["content"] = _join_text_parts(message["content"], role)
        if "tool_calls" in message:
            if message["tool_calls"]:
                for call in message["tool_calls"]:
                    function = call.get("function") if isinstance(call, dict) else None
                    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                        with contextlib.suppress(json.JSONDecodeError):  # malformed: keep the client's text
                            function["arguments"] = json.loads(function["arguments"])
            else:
                del message["tool_calls"]
        reasoning = next(
            (message[k] for k in ("reasoning_content", "reasoning", "thinking") if message.get(k) is not None), None
        )
        if reasoning is not None:
            message.setdefault("thinking", reasoning)
            message["reasoning_content"] = message["reasoning"] = reasoning
        prepared.append(message)
    return prepared


_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """Render one conversation. Variables: messages, tools, documents, add_generation_prompt, every
    special token by name (``bos_token``...), then ``template_kwargs`` (``enable_thinking``...), which win.
    ``continue_final_message`` ends the prompt inside the last message, as transformers does (see
    ``_cut_after_final_message``)."""
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:  # transformers refuses the pair the same way
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: one continues "
                                "the last message, the other starts a new assistant turn")
    compiled, wants_parts = _compile(template)
    reserved = _RESERVED.intersection(template_kwargs or {})
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(reserved)}; use the request fields")
    variables = {**(special_tokens or {}), **_plain(template_kwargs or {})}
    prepared = prepare_messages(messages, wants_parts)
    try:
        rendered = compiled.render(
            messages=prepared,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e.message or e}") from e
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
        raise ChatTemplateError(f"chat template failed on this conversation: {type(e).__name__}: {e}") from e
    return _cut_after_final_message(rendered, messages[-1]) if continue_final_message else rendered


def _cut_after_final_message(rendered: str, final: dict[str, Any]) -> str:
    """transformers' ``continue_final_message``: the prompt ends where the last message's text ends (the end-of-turn
    markup the template writes after it is cut), so the model goes on with that message instead of starting a new
    one; of a list of parts, the last text part counts. Spacing the template trimmed off the text's end is not
    restored, as in transformers."""
    content = final.get("content")
    if isinstance(content, list):
        texts = [p if isinstance(p, str) else p["text"] for p in content
                 if isinstance(p, str) or (isinstance(p, dict) and isinstance(p.get("text"), str))]
        if not texts:
            raise ChatTemplateError("continue_final_message: the final message has no text to continue")
        content = texts[-1]
    if not isinstance(content, str) or content.strip() not in rendered:
        raise ChatTemplateError("continue_final_message: the chat template does not write the final message's text "
                                "whole, so there is no place to continue it from")
    start = rendered.rindex(content.strip())
    if rendered[start : start + len(content.lstrip())] == content:
        return rendered[: start + len(content.lstrip())]
    return rendered[: start + len(content.strip())]
