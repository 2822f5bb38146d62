"""Qwen3-Coder XML values become JSON of the type the tool's schema gives the parameter."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tool_parser_fixtures import TOOLS, run

from candle_vllm.api.tool_parsers import make_parser

# (schema of parameter "p", the text the model wrote, the value the tool must get)
CONVERSIONS: list[tuple[dict[str, Any] | None, str, Any]] = [
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, " -7 ", -7),
    ({"type": "integer"}, "4.0", "4.0"),  # not an integer: the model's text is kept
    ({"type": "integer"}, "many", "many"),
    ({"type": "number"}, "3.5", 3.5),
    ({"type": "number"}, "2", 2),
    ({"type": "number"}, "1e3", 1000.0),
    ({"type": "number"}, "nan", "nan"),
    ({"type": "boolean"}, "true", True),
    ({"type": "boolean"}, "False", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "null"}, "None", None),
    ({"type": ["string", "null"]}, "null", None),
    ({"type": ["string", "null"]}, "plain words", "plain words"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "5", 5),
    ({"oneOf": [{"type": "boolean"}, {"type": "array"}]}, "[true, 2]", [True, 2]),
    ({"type": "object"}, '{"a": [1, {"b": null}], "ü": "ß"}', {"a": [1, {"b": None}], "ü": "ß"}),
    ({"type": "object"}, "{'a': True, 'b': None}", {"a": True, "b": None}),  # a Python literal
    ({"type": "object"}, "{broken", "{broken"),
    ({"type": "array"}, '[1, "x", 2.5]', [1, "x", 2.5]),
    ({"type": "array"}, "(1, 2)", "(1, 2)"),  # a tuple is no array
    ({"type": "string"}, "42", "42"),
    ({"type": "string"}, "  spaced  ", "  spaced  "),
    ({"type": "string"}, "\n\ttwo lines\n\n", "\n\ttwo lines\n\n"),
    ({"enum": [1, 2, 3]}, "2", 2),
    ({"const": True}, "true", True),
    ({"description": "untyped"}, "true", "true"),
    (None, "42", "42"),  # a parameter the schema does not declare
]


def _tool(schema: dict[str, Any] | None) -> list[dict[str, Any]]:
    props = {"p": schema} if schema is not None else {}
    return [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}]


@pytest.mark.parametrize(("schema", "raw", "expected"), CONVERSIONS)
def test_value_conversion(schema: dict[str, Any] | None, raw: str, expected: Any) -> None:
    text = f"<tool_call>\n<function=f>\n<parameter=p>\n{raw}\n</parameter>\n</function>\n</tool_call>"
    for pieces in ([text], list(text)):
        result = run("qwen_coder", pieces, _tool(schema))
        assert len(result.calls) == 1
        got = json.loads(result.calls[0].arguments)
        assert json.dumps(got, sort_keys=True) == json.dumps({"p": expected}, sort_keys=True)


def test_values_without_newlines_and_many_parameters() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "array"}}, "required": ["a", "c"]}}}]
    text = ("Calling.<tool_call><function=f><parameter=a>1</parameter><parameter=b><div>\n</div></parameter>"
            "<parameter=c>[]</parameter></function></tool_call>")
    result = run("qwen_coder", list(text), tools)
    assert result.content == "Calling."
    assert [json.loads(c.arguments) for c in result.calls] == [{"a": 1, "b": "<div>\n</div>", "c": []}]


def test_a_call_without_parameters_is_an_empty_object() -> None:
    result = run("qwen_coder", ["<tool_call>\n<function=f>\n</function>\n</tool_call>"], _tool(None))
    assert [(c.name, c.arguments) for c in result.calls] == [("f", "{}")]


BARE = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"
# (text, whether it fails only after the header went out)
BARE_BROKEN = [
    ("<function=get_time>\n</function>", False),  # unknown tool
    ("<function=get_weather> is the tool I would call here.", False),  # a mention in prose
    ("<function=get_weather\nis a tool", False),  # no closing >
    ("<functions are not calls>", False),
    ("<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>", True),  # required key missing
]


@pytest.mark.parametrize(("text", "late"), BARE_BROKEN)
def test_broken_bare_calls_are_released_as_text(text: str, late: bool) -> None:
    for pieces in ([text], list(text)):
        result = run("qwen_coder", pieces, TOOLS)
        assert (result.content, result.calls) == (text, [])
        assert bool(result.deltas) == late  # a stream cannot take back a sent header
    result = run("qwen_coder", list(text + "\n" + BARE), TOOLS)
    assert result.content == text.rstrip()
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [("get_weather", {"city": "Paris"})]


def test_bare_header_waits_for_the_first_parameter() -> None:
    p = make_parser("qwen_coder", TOOLS)
    assert p.push("Sure.\n<function=get_weather>\n") == ("Sure.", [])
    shown, deltas = p.push("<parameter=")
    assert shown == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", "")]
    shown, deltas = p.push("city>\nParis\n</parameter>\n</function>")
    assert shown == "" and "".join(d.arguments for d in deltas) == '{"city": "Paris"}'
    assert p.finish() == ("", [])


def test_bare_calls_in_code_fences_are_text() -> None:
    fenced = f"Format:\n```xml\n{BARE}\n```\n"
    for pieces in ([fenced + BARE], list(fenced + BARE)):
        result = run("qwen_coder", pieces, TOOLS)
        assert result.content == fenced.rstrip()
        assert [c.name for c in result.calls] == ["get_weather"]
