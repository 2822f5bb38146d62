"""Tool calls and reasoning end to end: the official ``openai`` client against our server running the real
engine on a scripted model.

The model (registered under a test-only architecture) puts all probability on the next token of a script
chosen by position, so the engine, scheduler, sampler, detokenizer and HTTP layer all run for real while
the output is known. Its tokenizer is a real ``tokenizers`` byte-level BPE with ``<think>``, ``</think>``,
``<tool_call>``, ``</tool_call>`` as special tokens and a Qwen-style chat template. Expected calls, reasoning
and token counts come from the script literals, never from the code under test.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.config import ModelConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.models import registry
from candle_vllm.pyengine.models.base import CausalLM
from tests.api.conftest import ServerThread, running, tcp_bind

ARCH = "ScriptedTestForCausalLM"
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% elif open_think %}<think>
{% endif %}{% endif %}"""

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]
REASONING = "The user wants two things."
CALL_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL_TIME = '{"name": "get_time", "arguments": {"tz": "CET"}}'
TWO_CALLS = (f"<think>{REASONING}</think>\n\n<tool_call>\n{CALL_WEATHER}\n</tool_call>\n"
             f"<tool_call>\n{CALL_TIME}\n</tool_call>")
EXPECTED_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
CALL_ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


class ScriptedForCausalLM(CausalLM):
    """Logits with all mass on ``script[p - start]`` at position ``p`` (EOS outside the script); records the
    prompt tokens of each prefill so tests can read the rendered prompt the engine really got."""

    hf_name_from_gguf = staticmethod(lambda name: None)

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos = int(config.eos_token_id)
        self.kv_caches: list[torch.Tensor] = []
        self.start = 0
        self.script: list[int] = []
        self.prompts: list[list[int]] = []

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return {}

    def load_weights(self, weights: Any) -> set[str]:
        return set()

    def finish_loading(self) -> None:
        pass

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        if len(input_ids) > 1:
            self.prompts.append(input_ids.tolist())
        return positions.to(torch.float32).unsqueeze(1)  # the "hidden state" is the position

    def compute_logits(self, hidden: torch.Tensor, *, f32: bool = True) -> torch.Tensor:
        logits = torch.full((hidden.shape[0], self.vocab_size), -1e4, dtype=torch.float32)
        for row, pos in enumerate(hidden[:, 0].long().tolist()):
            k = pos + 1 - self.start
            logits[row, self.script[k] if 0 <= k < len(self.script) else self.eos] = 0.0
        return logits


def write_model(path: Path, template: str = TEMPLATE) -> int:
    """A model directory: config.json (test architecture), a byte-level BPE tokenizer.json, the template."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    eos = hf.token_to_id("<|im_end|>")
    config = {"architectures": [ARCH], "model_type": "scripted", "vocab_size": hf.get_vocab_size(),
              "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 2048, "eos_token_id": eos}
    (path / "config.json").write_text(json.dumps(config))
    return eos


@contextlib.contextmanager
def scripted_server(path: Path, enforce_parser: str | None) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.MODEL_REGISTRY, ARCH, ScriptedForCausalLM)
        args = EngineArgs(model=str(path), load_format="dummy", dtype="f32", mem=16, max_num_seqs=4,
                          disable_prefix_cache=True)
        config = ServerConfig(keepalive_s=5.0, enforce_parser=enforce_parser, served_model_names=["scripted"])
        with running(lambda: open_engine(args), config, tcp_bind()) as srv:
            yield srv


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = tmp_path_factory.mktemp("scripted")
    write_model(path)
    with scripted_server(path, "qwen") as srv:
        yield srv


class Chat:
    """Sends chat requests whose answer is ``script``: sets the model's script for the prompt's length."""

    def __init__(self, server: ServerThread) -> None:
        self.server = server
        self.model: ScriptedForCausalLM = server.engine.core.runner.model
        self.tokenizer = server.engine.tokenizer
        self.client = server.openai()

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   **template_kwargs: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, chat_template_kwargs=template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def script(self, prompt_ids: list[int], text: str) -> None:
        self.model.start = len(prompt_ids)
        self.model.script = self.tokenizer.encode(text, add_special_tokens=False)

    def create(self, script: str, prompt_ids: list[int], **kw: Any) -> Any:
        self.script(prompt_ids, script)
        kw.setdefault("messages", ASK)
        kw.setdefault("max_tokens", 400)
        return self.client.chat.completions.create(model="scripted", temperature=0, **kw)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def chat(server: ServerThread) -> Chat:
    return Chat(server)


def accumulate(chunks: list[Any]) -> dict[str, Any]:
    """Fold a stream the way clients do, checking OpenAI's delta invariants on the way."""
    content, reasoning, reasoning_alias = "", "", ""
    calls: dict[int, dict[str, Any]] = {}
    finishes = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        extra = delta.model_extra or {}
        reasoning += extra.get("reasoning_content") or ""
        reasoning_alias += extra.get("reasoning") or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, "the first fragment names the call"
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None, "id and name are sent once"
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    assert reasoning == reasoning_alias
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)],
            "finish": finishes, "usage": chunks[-1].usage}


def test_streamed_tool_calls_accumulate_to_the_whole_response(chat: Chat) -> None:
    prompt = chat.prompt_ids(ASK, TOOLS)
    whole = chat.create(TWO_CALLS, prompt, tools=TOOLS)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == EXPECTED_CALLS
    assert all(CALL_ID.match(c.id) and c.type == "function" for c in msg.tool_calls)
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == REASONING
    reasoning_tokens = chat.count(f"<think>{REASONING}</think>")  # the markers count as reasoning
    assert whole.usage.completion_tokens == chat.count(TWO_CALLS) + 1  # + EOS
    assert whole.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert whole.usage.prompt_tokens == len(prompt)

    chunks = list(chat.create(TWO_CALLS, prompt, tools=TOOLS, stream=True,
                              stream_options={"include_usage": True}))
    got = accumulate(chunks)
    assert got["finish"] == ["tool_calls"] and got["content"] == "" and got["reasoning"] == REASONING
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert all(CALL_ID.match(c["id"]) for c in got["calls"])
    assert got["usage"].completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert got["usage"].completion_tokens == whole.usage.completion_tokens
    # Arguments arrived as fragments, not only whole.
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices) >= len(EXPECTED_CALLS)


def test_text_around_calls_parallel_off_and_tool_choice_none(chat: Chat) -> None:
    script = f"Let me look.\n<tool_call>\n{CALL_WEATHER}\n</tool_call>\n<tool_call>\n{CALL_TIME}\n</tool_call>"
    prompt = chat.prompt_ids(ASK, TOOLS)
    one = chat.create(script, prompt, tools=TOOLS, parallel_tool_calls=False)
    msg = one.choices[0].message
    assert msg.content.strip() == "Let me look." and one.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == EXPECTED_CALLS[:1]
    streamed = accumulate(list(chat.create(script, prompt, tools=TOOLS, parallel_tool_calls=False, stream=True)))
    assert streamed["content"] == msg.content and len(streamed["calls"]) == 1

    # tool_choice none: no tools in the prompt and nothing parsed; the tags stay in the text.
    bare = chat.prompt_ids(ASK)
    none = chat.create(script, bare, tools=TOOLS, tool_choice="none")
    assert none.usage.prompt_tokens == len(bare) and chat.model.prompts[-1] == bare
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert CALL_WEATHER in none.choices[0].message.content


def test_reasoning_split_switches_and_open_prompt(chat: Chat) -> None:
    answer = "<think>Paris is in France.</think>\n\nIt is sunny."
    on = chat.create(answer, chat.prompt_ids(ASK))
    assert on.choices[0].message.content == "\n\nIt is sunny."
    assert on.choices[0].message.model_extra["reasoning_content"] == "Paris is in France."
    assert on.usage.completion_tokens_details.reasoning_tokens == chat.count("<think>Paris is in France.</think>")

    # Disabled three ways: each reaches the template (its prompt closes an empty think block) and the split.
    closed = chat.prompt_ids(ASK, enable_thinking=False)
    for extra in ({"enable_thinking": False}, {"thinking": {"type": "disabled"}},
                  {"chat_template_kwargs": {"enable_thinking": False}}):
        off = chat.create("It is sunny.", closed, extra_body=extra)
        assert off.usage.prompt_tokens == len(closed) and chat.model.prompts[-1] == closed
        assert off.choices[0].message.content == "It is sunny."
        assert off.choices[0].message.model_extra.get("reasoning_content") is None

    # The template opened <think> in the prompt: the output starts as reasoning.
    opened = chat.prompt_ids(ASK, open_think=True)
    script = "Sunny, surely.</think>It is sunny."
    r = chat.create(script, opened, extra_body={"chat_template_kwargs": {"open_think": True}})
    assert r.choices[0].message.model_extra["reasoning"] == "Sunny, surely."
    assert r.choices[0].message.content == "It is sunny."
    assert r.usage.completion_tokens_details.reasoning_tokens == chat.count("Sunny, surely.</think>")
    streamed = accumulate(list(chat.create(script, opened, stream=True, stream_options={"include_usage": True},
                                           extra_body={"chat_template_kwargs": {"open_think": True}})))
    assert (streamed["reasoning"], streamed["content"]) == ("Sunny, surely.", "It is sunny.")
    assert streamed["usage"].completion_tokens_details.reasoning_tokens == chat.count("Sunny, surely.</think>")

    with pytest.raises(openai.BadRequestError, match="contradicting thinking switches"):
        chat.create("x", closed, extra_body={"enable_thinking": True, "thinking": False})


def test_history_with_tool_results_renders_arguments_as_objects(chat: Chat) -> None:
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = chat.create("It is sunny.", chat.prompt_ids(history, TOOLS), messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    seen = chat.tokenizer.decode(chat.model.prompts[-1], skip_special_tokens=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in seen  # a dict, not a quoted string
    assert "<tool_response>sunny</tool_response>" in seen


CALL = {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        ([*ASK, {"role": "assistant", "tool_calls": [CALL]}, {"role": "user", "content": "and?"}], "call_9"),
        ([*ASK, {"role": "assistant", "tool_calls": [CALL]}], "call_9"),
        ([*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "1"}], "call_x"),
        ([*ASK, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_9", "content": "1"},
          {"role": "tool", "tool_call_id": "call_9", "content": "2"}], "call_9"),
    ],
    ids=["unanswered-before-user", "unanswered-at-end", "unknown-id", "answered-twice"],
)
def test_tool_history_errors_are_400(chat: Chat, messages: list[dict[str, Any]], named: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat.client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, max_tokens=4)
    err = info.value.body
    assert err["param"] == "messages" and named in err["message"] and err["type"] == "invalid_request_error"


def test_tool_choice_errors_are_400(chat: Chat) -> None:
    with pytest.raises(openai.BadRequestError, match="needs tools") as info:
        chat.client.chat.completions.create(model="scripted", messages=ASK, tool_choice="required", max_tokens=4)
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="'nope'") as info:
        chat.client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, max_tokens=4,
                                            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"


def test_required_and_named_tool_choice_constrain_the_output(chat: Chat) -> None:
    """``required``: the output is a JSON list of calls; named: the output is the function's arguments. Both
    run under the schema grammar (the script follows it, so every token is allowed)."""
    prompt = chat.prompt_ids(ASK, TOOLS)
    calls = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{"tz":"CET"}}]'
    whole = chat.create(calls, prompt, tools=TOOLS, tool_choice="required")
    got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert got == EXPECTED_CALLS and whole.choices[0].finish_reason == "tool_calls"
    streamed = accumulate(list(chat.create(calls, prompt, tools=TOOLS, tool_choice="required", stream=True)))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == EXPECTED_CALLS
    assert streamed["finish"] == ["tool_calls"]

    named = {"type": "function", "function": {"name": "get_time"}}
    whole = chat.create('{"tz":"CET"}', prompt, tools=TOOLS, tool_choice=named)
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", '{"tz":"CET"}')
    # A named tool_choice ends with "stop", as OpenAI and vLLM answer it; auto and required end with "tool_calls".
    assert whole.choices[0].message.content is None and whole.choices[0].finish_reason == "stop"
    streamed = accumulate(list(chat.create('{"tz":"CET"}', prompt, tools=TOOLS, tool_choice=named, stream=True)))
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [("get_time", '{"tz":"CET"}')]
    assert streamed["finish"] == ["stop"]

    # The grammar really constrains: a script that breaks the schema cannot come out as written.
    off_schema = chat.create("It is sunny.", prompt, tools=TOOLS, tool_choice=named, max_tokens=20)
    assert off_schema.choices[0].message.content is None
    assert not off_schema.choices[0].message.tool_calls[0].function.arguments.startswith("It")


def test_without_a_parser_tools_are_offered_and_the_answer_is_text(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # A template that teaches no call format and no --enforce-parser: the model family gives no parser.
    write_model(tmp_path, TEMPLATE.replace("tool_call>", "call>"))
    script = f"<tool_call>\n{CALL_WEATHER}\n</tool_call>"
    with caplog.at_level(logging.WARNING), scripted_server(tmp_path, None) as srv:
        chat = Chat(srv)
        for _ in range(2):
            r = chat.create(script, chat.prompt_ids(ASK, TOOLS), tools=TOOLS)
            assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
            assert CALL_WEATHER in r.choices[0].message.content
            assert '"name": "get_weather"' in chat.tokenizer.decode(chat.model.prompts[-1])  # tools offered
    assert sum("no tool-call parser" in rec.getMessage() for rec in caplog.records) == 1  # logged once


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.mark.parametrize(("script", "extra"), [
    (f"<think>{REASONING}</think>\n\nIt is sunny.", {}),
    ("Hi <think>plan</think> there", {}),  # text, reasoning, text: still one message item
    ("<think>a plan that runs past the limit", {"max_output_tokens": 6}),
    (TWO_CALLS, {"tools": RESPONSES_TOOLS}),
])
def test_responses_api_items_whole_and_streamed(chat: Chat, script: str, extra: dict[str, Any]) -> None:
    """/v1/responses on a model that thinks and calls tools: one reasoning item, one message item and the calls,
    as the chat endpoint splits the same output; the SDK's stream helper folds the events into the whole
    response (items, ids per item, statuses)."""
    tools = TOOLS if "tools" in extra else None
    prompt = chat.prompt_ids(ASK, tools)
    chat.script(prompt, script)
    body: dict[str, Any] = {"model": "scripted", "input": ASK[0]["content"], "temperature": 0, **extra}
    whole = chat.client.responses.create(**body)
    with chat.client.responses.stream(**body) as stream:
        events = list(stream)
        final = events[-1].response
    reference = chat.create(script, prompt, tools=tools, **({"max_tokens": extra["max_output_tokens"]}
                                                           if "max_output_tokens" in extra else {}))
    message = reference.choices[0].message
    kinds = [item.type for item in whole.output]
    assert kinds == [item.type for item in final.output]
    assert sorted(kinds) == sorted([*(["reasoning"] if message.model_extra.get("reasoning") else []),
                                    *(["message"] if message.content else []),
                                    *(["function_call"] * len(message.tool_calls or []))])  # in order of appearance
    for got in (whole, final):
        texts = {item.type: item.content[0].text for item in got.output if item.type in ("reasoning", "message")}
        assert texts.get("reasoning") == message.model_extra.get("reasoning")
        assert texts.get("message") == (message.content or None)
        calls = [(c.name, json.loads(c.arguments)) for c in got.output if c.type == "function_call"]
        assert calls == [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        assert got.status == ("incomplete" if reference.choices[0].finish_reason == "length" else "completed")
        assert got.usage.output_tokens_details.reasoning_tokens == reference.usage.completion_tokens_details.reasoning_tokens
    assert len({item.id for item in final.output}) == len(final.output)
    assert [e.type for e in events].count("response.output_item.added") == len(final.output)
