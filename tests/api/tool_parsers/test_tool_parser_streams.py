"""Every parser on realistic outputs: token by token through a trained tokenizer of the model's family, one
character at a time and in random pieces, all give exactly the calls and content of the whole text; the
streamed fragments add up to each call's arguments."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from tool_parser_fixtures import TOOLS, Case, Result, cases, random_pieces, run, token_pieces, tokenizers

from candle_vllm.api.tool_parsers import PARSER_NAMES, parse_tool_calls

CASES = [(parser, case) for parser, group in cases().items() for case in group]
IDS = [f"{parser}-{case.name}" for parser, case in CASES]
FAMILY_TAGS = {"qwen": ("<tool_call>", "</tool_call>"), "qwen_coder": ("<tool_call>", "</tool_call>"),
               "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), "llama3": ("<|python_tag|>", "<|eom_id|>", "<|eot_id|>"),
               "json": ()}


def _typed(value: Any) -> str:
    """JSON with sorted keys: 3 != 3.0 != true, unlike Python's ==."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _check(result: Result, case: Case) -> None:
    assert result.content == case.content
    got = [(c.name, _typed(json.loads(c.arguments))) for c in result.calls]
    assert got == [(name, _typed(args)) for name, args in case.calls]
    # The stream: each call's id and name once, in its first delta; fragments add up to its arguments.
    by_index: dict[int, list[Any]] = {}
    for d in result.deltas:
        if d.index not in by_index:
            assert d.id is not None and d.name is not None and d.arguments == ""
            by_index[d.index] = [d.id, d.name, ""]
        else:
            assert d.id is None and d.name is None
            by_index[d.index][2] += d.arguments
    assert sorted(by_index) == list(range(len(by_index)))
    assert [tuple(v) for v in by_index.values()] == [(c.id, c.name, c.arguments) for c in result.calls]
    ids = [c.id for c in result.calls]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def test_cases_cover_every_parser() -> None:
    assert set(cases()) == set(PARSER_NAMES)


@pytest.mark.parametrize(("parser", "case"), CASES, ids=IDS)
def test_whole_text(parser: str, case: Case) -> None:
    _check(run(parser, [case.text]), case)
    content, calls = parse_tool_calls(parser, case.text, TOOLS)
    assert content == case.content and [c.name for c in calls] == [n for n, _ in case.calls]


@pytest.mark.parametrize(("parser", "case"), CASES, ids=IDS)
def test_token_by_token(parser: str, case: Case) -> None:
    tok = tokenizers()[parser]
    pieces = token_pieces(tok, case.text)
    assert len(pieces) > len(case.text) / 8  # really cut into tokens
    for tag in FAMILY_TAGS[parser]:
        if tag in case.text:  # the family's tags are single special tokens
            assert tag in pieces
    _check(run(parser, pieces), case)


@pytest.mark.parametrize(("parser", "case"), CASES, ids=IDS)
def test_char_by_char_and_random_pieces(parser: str, case: Case) -> None:
    _check(run(parser, list(case.text)), case)
    for seed in range(5):
        _check(run(parser, random_pieces(case.text, seed)), case)
