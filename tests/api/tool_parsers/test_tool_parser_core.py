"""The shared streaming behaviour: partial markers, code fences, failed calls released as text, what a
stream sends before a call is complete, call ids, validation against the request's tools."""

from __future__ import annotations

import json
import re

import pytest
from tool_parser_fixtures import TOOLS, cases, run

from candle_vllm.api.tool_parsers import ToolCallDelta, make_parser, parse_tool_calls

PARIS_ARGS = '{"city": "Paris"}'
CALL_TEXT = {
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS_ARGS + "}\n</tool_call>",
    "qwen_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "mistral": "[TOOL_CALLS]get_weather[ARGS]" + PARIS_ARGS,
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": ' + PARIS_ARGS + "}",
    "json": '{"name": "get_weather", "arguments": ' + PARIS_ARGS + "}",
}
MARKERS = {"qwen": "<tool_call>", "qwen_coder": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}


def _expected_release(prefix: str, marker: str) -> str:
    """What may be shown of ``prefix``: all but a suffix that could still start ``marker``, and trailing
    whitespace (shown with the next visible text)."""
    for j in range(len(prefix)):
        if marker.startswith(prefix[j:]):
            prefix = prefix[:j]
            break
    return prefix.rstrip()


@pytest.mark.parametrize("parser", sorted(MARKERS))
def test_partial_marker_held_at_every_split_point(parser: str) -> None:
    marker = MARKERS[parser]
    text = "Sure <b>[x]</b> <|x| here:\n" + CALL_TEXT[parser] + "\nafter"
    start = text.index(marker)
    for k in range(len(text) + 1):
        p = make_parser(parser, TOOLS)
        shown, _ = p.push(text[:k])
        if k <= start + len(marker):
            assert shown == _expected_release(text[:k], marker), k
        rest, _ = p.push(text[k:])
        tail, _ = p.finish()
        assert shown + rest + tail == "Sure <b>[x]</b> <|x| here:\nafter", k
        assert [(c.name, c.arguments) for c in p.calls] == [("get_weather", PARIS_ARGS)], k


@pytest.mark.parametrize("parser", sorted(MARKERS))
def test_near_misses_are_text(parser: str) -> None:
    marker = MARKERS[parser]
    text = f"a {marker[:-1]} b {marker[:-1]}x {marker[1:]} {marker.swapcase()} {marker[:-2]}"
    for pieces in ([text], list(text)):
        result = run(parser, pieces)
        assert (result.content, result.calls, result.deltas) == (text, [], [])


@pytest.mark.parametrize("parser", sorted(CALL_TEXT))
def test_markers_inside_code_fences_are_text(parser: str) -> None:
    call = CALL_TEXT[parser]
    fenced = f"Example:\n```json\n{call}\n```\n  ````\n{call}\n````\nInline ``` is no fence: "
    text = fenced + ("\n" if parser in ("json", "llama3") else "") + call
    for pieces in ([text], list(text)):
        result = run(parser, pieces)
        assert result.content == fenced.rstrip()
        assert [c.name for c in result.calls] == ["get_weather"]
    unclosed = f"```\n{call}\n"
    assert run(parser, list(unclosed)).content == unclosed


BROKEN = {
    "qwen": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',  # trailing comma
        "<tool_call>\n{'name': 'get_weather', 'arguments': {}}\n</tool_call>",  # not JSON
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\nris"}}\n</tool_call>',  # raw newline
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',  # string
        '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # unknown tool
        '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>',  # required key missing
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}, "id": 1}\n</tool_call>',  # extra key
        '<tool_call>\n{"name": ["get_weather"], "arguments": {"city": "Paris"}}\n</tool_call>',  # name not a string
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}} trailing</tool_call>',
    ],
    "qwen_coder": [
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",  # unknown tool
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n"
        "</parameter>\n</function>\n</tool_call>",  # a parameter twice
        "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>",  # JSON, not XML
        "<tool_call>\n<function=get_weather\nis a tool\n",  # no closing >
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}},]',
        '[TOOL_CALLS][]',
        '[TOOL_CALLS]get_time[ARGS]{}',
        '[TOOL_CALLS]get_weather[ARGS]["Paris"]',
        '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
        '[TOOL_CALLS] and some prose about tools',
    ],
    "llama3": [
        '<|python_tag|>brave_search.call(query="weather")',  # built-in tool syntax: not JSON calls
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "nope", "parameters": {}}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; and more',
    ],
    "json": [
        '{"name": "get_weather", "arguments": {"city": "Paris"}, "extra": true}',
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather"}]',
        '{"function": "get_weather"}',
    ],
}


@pytest.mark.parametrize(("parser", "text"), [(p, t) for p, ts in BROKEN.items() for t in ts])
def test_failed_calls_are_released_as_text(parser: str, text: str) -> None:
    for pieces in ([text], list(text)):
        result = run(parser, pieces)
        assert result.content == text
        assert result.calls == []
    # a valid call after the broken one is still read
    good = CALL_TEXT[parser]
    content, calls = parse_tool_calls(parser, text + "\n" + good, TOOLS)
    assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert content == text.rstrip()  # whitespace right before a call is not content


WEATHER = ("get_weather", PARIS_ARGS)
# Outputs cut by max_tokens after a call's header went out: (parser, text, content, calls).
CUT = [
    ("qwen", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "Checking.",
     [("get_weather", '{"city": "Par')]),
    ("qwen", '<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS_ARGS + "}\n</tool_", "", [WEATHER]),
    ("qwen_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", "",
     [("get_weather", '{"city": "Paris"')]),
    ("qwen_coder", "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", "",
     [("get_weather", '{"city": "Paris"')]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + PARIS_ARGS[:-1], "", [("get_weather", PARIS_ARGS[:-1])]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + PARIS_ARGS + '}, {"name": "get_weather", "argu',
     "", [WEATHER]),
    ("llama3", '{"name": "get_weather", "parameters": ' + PARIS_ARGS, "", [WEATHER]),
    ("llama3", '{"name": "get_weather", "parameters": ' + PARIS_ARGS + '}; {"name": "get_weather", "parameters": {"ci',
     "", [WEATHER, ("get_weather", '{"ci')]),
    ("json", '{"name": "get_weather", "arguments": ' + PARIS_ARGS, "", [WEATHER]),
    ("json", '[{"name": "get_weather", "arguments": ' + PARIS_ARGS + '}, {"name": "get_weather", "arguments": {"ci',
     "", [WEATHER, ("get_weather", '{"ci')]),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CUT)
def test_a_cut_output_keeps_the_calls_it_streamed(parser: str, text: str, content: str,
                                                 calls: list[tuple[str, str]]) -> None:
    """The output ends inside a call region after headers went out (``max_tokens``): those calls stay calls,
    arguments as far as they got; the region's unsent rest is dropped, never shown as content as well."""
    for pieces in ([text], list(text)):
        result = run(parser, pieces)
        assert (result.content, [(c.name, c.arguments) for c in result.calls]) == (content, calls)
        assert _accumulated(result.deltas) == calls


def _accumulated(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """The calls a client folding these deltas ends up with."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ["", ""])
        call[0] += d.name or ""
        call[1] += d.arguments
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)]


@pytest.mark.parametrize("parser", sorted(cases()))
def test_every_cut_of_an_output_streams_to_the_whole_text_result(parser: str) -> None:
    """Cut anywhere (as ``max_tokens`` does), streamed per character and parsed whole give the same content and
    calls, and the streamed deltas add up to exactly those calls: nothing is sent as a call and as content."""
    for case in cases()[parser]:
        for k in range(len(case.text) + 1):
            whole, streamed = run(parser, [case.text[:k]]), run(parser, list(case.text[:k]))
            calls = [(c.name, c.arguments) for c in whole.calls]
            assert streamed.content == whole.content, (case.name, k)
            assert [(c.name, c.arguments) for c in streamed.calls] == calls, (case.name, k)
            assert _accumulated(streamed.deltas) == calls, (case.name, k)


def test_broken_call_after_its_header_went_out() -> None:
    """A stream cannot take back a sent header: the call is left out of ``calls``, its text is content, and
    the next call gets the next index."""
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"} oops\n</tool_call>\n'
    text = bad + CALL_TEXT["qwen"]
    result = run("qwen", list(text))
    assert result.content == bad.rstrip()
    headers = [d for d in result.deltas if d.id is not None]
    assert [d.index for d in headers] == [0, 1]
    assert [(c.id, c.arguments) for c in result.calls] == [(headers[1].id, PARIS_ARGS)]
    assert parse_tool_calls("qwen", text, TOOLS)[0] == result.content


@pytest.mark.parametrize("parser", ["qwen", "llama3", "json", "mistral"])
def test_arguments_stream_as_they_arrive(parser: str) -> None:
    text = CALL_TEXT[parser].replace(PARIS_ARGS, '{"city": "Paris", "unit": "celsius"}')
    args_at = text.index('{"city"')
    p = make_parser(parser, TOOLS)
    shown, deltas = p.push(text[: args_at - 1])
    assert (shown, deltas) == ("", [])  # the name alone does not open the call
    shown, deltas = p.push(text[args_at - 1 : args_at + 15])
    assert shown == "" and len(deltas) == 2
    assert (deltas[0].name, deltas[0].arguments, deltas[1].arguments) == ("get_weather", "", '{"city": "Paris')
    shown, deltas = p.push(text[args_at + 15 :])
    assert "".join(d.arguments for d in deltas).startswith('", "unit": "celsius"}')


def test_qwen_coder_sends_one_fragment_per_parameter() -> None:
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
            "<parameter=days>\n 7 \n</parameter>\n</function>\n</tool_call>")
    p = make_parser("qwen_coder", TOOLS)
    fragments = []
    for ch in text:
        shown, deltas = p.push(ch)
        assert shown == ""
        fragments += [(d.name, d.arguments) for d in deltas]
    assert fragments == [("get_weather", ""), (None, '{"city": "São Paulo"'), (None, ', "days": 7'), (None, "}")]
    assert p.finish() == ("", [])
    assert p.calls[0].arguments == '{"city": "São Paulo", "days": 7}'


def test_ids_are_unique_and_shaped() -> None:
    text = "\n".join([CALL_TEXT["qwen"]] * 300)
    content, calls = parse_tool_calls("qwen", text, TOOLS)
    assert content == "" and len(calls) == 300
    assert len({c.id for c in calls}) == 300
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in calls)


def test_tools_none_accepts_any_name_and_empty_tools_none() -> None:
    text = '<tool_call>\n{"name": "anything", "arguments": {"x": 1}}\n</tool_call>'
    assert [c.name for c in parse_tool_calls("qwen", text, None)[1]] == ["anything"]
    assert parse_tool_calls("qwen", text, []) == (text, [])


def test_missing_arguments_mean_an_empty_object() -> None:
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    for text in ('<tool_call>{"name": "now"}</tool_call>', '{"arguments": {}, "name": "now"}'):
        parser = "qwen" if text.startswith("<") else "json"
        result = run(parser, list(text), tools)
        assert [(c.name, c.arguments) for c in result.calls] == [("now", "{}")]
        assert "".join(d.arguments for d in result.deltas) == "{}"


def test_unknown_parser_name() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser 'hermes'; choose one of qwen, qwen_coder"):
        make_parser("hermes", TOOLS)
