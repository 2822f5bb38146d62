"""End to end: OpenAI's Responses API (``client.responses``) against our server and the real engine (SmolLM2, F32).
A Responses request is the chat request it describes, so the chat endpoint on the same model is the reference:
the same greedy text, calls and usage, whole or streamed."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from candle_vllm.api.responses_input import ResponsesRequest, chat_request
from tests.api.conftest import ServerThread

SYSTEM = "You are terse."
QUESTION = "Name three colours of the rainbow."
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"], "additionalProperties": False}}


def chat_reference(server: ServerThread, model: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return server.openai().chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def test_text_response_equals_the_chat_answer(f32_server: ServerThread, f32_model: str) -> None:
    client = f32_server.openai()
    got = client.responses.create(model=f32_model, instructions=SYSTEM, input=QUESTION, temperature=0,
                                  max_output_tokens=12)
    want = chat_reference(f32_server, f32_model, [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": QUESTION}], max_completion_tokens=12)
    assert got.object == "response" and got.id.startswith("resp_") and got.model == f32_model
    assert got.output_text == want.choices[0].message.content
    assert [item.type for item in got.output] == ["message"]
    assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens, want.usage.total_tokens)
    finished = want.choices[0].finish_reason == "stop"
    assert got.status == ("completed" if finished else "incomplete")
    assert (got.incomplete_details is None) == finished and got.store is False


def test_stream_events_add_up_to_the_final_response(f32_server: ServerThread, f32_model: str) -> None:
    """Sequence numbers count from 0; the text deltas join to the final object's text, which equals the whole
    (non-streamed) answer; the item is announced, filled and closed once."""
    client = f32_server.openai()
    kw: dict[str, Any] = {"model": f32_model, "input": QUESTION, "temperature": 0, "max_output_tokens": 10}
    events = list(client.responses.create(stream=True, **kw))
    whole = client.responses.create(**kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete")
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text and text
    assert final.output[0].id == next(e.item.id for e in events if e.type == "response.output_item.added")
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_conversation_items_become_chat_turns(f32_server: ServerThread, f32_model: str) -> None:
    """Earlier turns as items (a developer message, text parts, an assistant reply) give the chat answer to the
    same conversation."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": QUESTION}]
    items = [{"type": "message", "role": "developer", "content": SYSTEM},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": QUESTION}]
    got = f32_server.openai().responses.create(model=f32_model, input=items, temperature=0, max_output_tokens=12)
    want = chat_reference(f32_server, f32_model, messages, max_completion_tokens=12)
    assert got.output_text == want.choices[0].message.content
    assert got.usage.input_tokens == want.usage.prompt_tokens


def test_function_call_items_become_an_assistant_turn_and_tool_messages() -> None:
    """The Responses items of a tool loop as the chat turns OpenAI's two APIs agree on: consecutive calls in one
    assistant turn, each output a tool message naming its call; reasoning items of earlier turns left out."""
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo"},
                                     {"type": "input_text", "text": "and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Sun"}]},
    ], "instructions": "Be brief.", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 9, "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}})
    chat = chat_request(req)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo\nand Rome?"},  # parts joined by newlines, as chat joins them
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "Rain", "tool_call_id": "c1"},
        {"role": "tool", "content": "Sun", "tool_call_id": "c2"},
    ]
    assert chat.tool_dicts() == [{"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items()
                                                                    if k != "type"}}]
    assert chat.tool_choice is not None and chat.tool_choice.model_dump()["function"] == {"name": "get_weather"}
    assert chat.max_completion_tokens == 9
    assert chat.response_format is not None and chat.response_format.model_dump()["json_schema"] == {
        "name": "w", "schema": {"type": "object"}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_tool_call_is_a_function_call_item(f32_server: ServerThread, f32_model: str, stream: bool) -> None:
    client = f32_server.openai()
    kw: dict[str, Any] = {"model": f32_model, "input": "What is the weather in Paris?", "tools": [WEATHER_TOOL],
                          "tool_choice": "required", "temperature": 0, "max_output_tokens": 40}
    response = list(client.responses.create(stream=True, **kw))[-1].response if stream else client.responses.create(
        **kw)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and "city" in json.loads(c.arguments) for c in calls)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
    want = chat_reference(f32_server, f32_model, [{"role": "user", "content": kw["input"]}], tools=[chat_tool],
                          tool_choice="required", max_completion_tokens=40).choices[0].message.tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in want]
    assert all(c.call_id == c.id.removeprefix("fc_") for c in calls)


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"n": 2}, "n"),  # chat's fields are not the Responses API's: taken, they would be lost in the one message
    ({"logprobs": True}, "logprobs"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),  # chat's check, under the Responses field's name
])
def test_what_cannot_be_honoured_is_a_400(f32_server: ServerThread, f32_model: str, body: dict[str, Any],
                                          param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        f32_server.openai().responses.create(model=f32_model, input=QUESTION, extra_body=body)
    assert info.value.body["param"] == param
