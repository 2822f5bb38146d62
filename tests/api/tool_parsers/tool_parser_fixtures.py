"""Model outputs with tool calls, the tokenizers of their families, and ways to feed them to a parser.

Tokenizers are byte-level BPEs trained here (``tokenizers``) with each family's special tokens, as the
model authors' are; outputs are decoded token by token through the engine's IncrementalDetokenizer, as
the server sees them. Where a published chat template writes the call format (Qwen3, Llama 3.1) the
expected model text is rendered from that template; other formats are written out from their docs.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pyengine" / "tokenizer"))

from chat_template_texts import LLAMA31, QWEN3  # noqa: F401  (published templates, for the tests)
from hf_dirs import llama3_dir, qwen3_dir
from tokenizer_fixtures import QWEN2_REGEX, train_byte_level_bpe

from candle_vllm.api.tool_parsers import ToolCall, ToolCallDelta, make_parser
from candle_vllm.pyengine.tokenizer.base import Tokenizer
from candle_vllm.pyengine.tokenizer.detokenizer import IncrementalDetokenizer
from candle_vllm.pyengine.tokenizer.hf import load_tokenizer_from_hf_dir

# Mistral's Tekken (tiktoken-style) split pattern, as published in mistral-common.
TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                       "filters": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["query"]}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}, "precision": {"type": "number"},
                       "exact": {"type": "boolean"}, "note": {"type": ["string", "null"]},
                       "steps": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "required": ["expression"]}}},
]

PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
TOKYO = ("get_weather", {"city": "東京 🗼", "days": 3})
NESTED = ("search", {"query": "café \"best\" ☕ \\ slash", "limit": 5,
                     "filters": {"range": {"from": -1.5, "to": 2e3}, "open": True, "owner": None},
                     "tags": ["a", "b\nc", "😀"]})
ESCAPED = ("write_file", {"path": "C:\\tmp\\notes.md",
                          "content": "line 1\n\tline 2 \"quoted\" </tool_call> <tool_call> [TOOL_CALLS] {x}\n"})
CALC = ("calc", {"expression": "2**10 / 3", "precision": 0.001, "exact": False, "note": None, "steps": 4})


@dataclass(frozen=True)
class Case:
    """A model output and what must come out of it."""

    name: str
    text: str
    content: str
    calls: tuple[tuple[str, dict[str, Any]], ...]


def _hermes(call: tuple[str, dict[str, Any]]) -> str:
    return "<tool_call>\n" + json.dumps({"name": call[0], "arguments": call[1]}, ensure_ascii=False) + "\n</tool_call>"


def _xml(call: tuple[str, dict[str, Any]]) -> str:
    return f"<tool_call>\n{_bare(call)}\n</tool_call>"


def _bare(call: tuple[str, dict[str, Any]]) -> str:
    """A Qwen3-Coder call without its ``<tool_call>`` wrapper, as the model sometimes writes it."""
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
        for k, v in call[1].items()
    )
    return f"<function={call[0]}>\n{params}</function>"


def _v11(call: tuple[str, dict[str, Any]], tag: str = "[ARGS]") -> str:
    return "[TOOL_CALLS]" + call[0] + tag + json.dumps(call[1], ensure_ascii=False)


def _call_json(call: tuple[str, dict[str, Any]], key: str) -> str:
    return json.dumps({"name": call[0], key: call[1]}, ensure_ascii=False)


@cache
def tokenizers() -> dict[str, Tokenizer]:
    """One trained tokenizer per family, keyed by parser name."""
    root = Path(__import__("tempfile").mkdtemp(prefix="tool-parser-tok-"))
    qwen = load_tokenizer_from_hf_dir(qwen3_dir(root / "qwen3"))
    llama = load_tokenizer_from_hf_dir(llama3_dir(root / "llama3"))
    mistral_hf = train_byte_level_bpe(TEKKEN_REGEX, MISTRAL_SPECIALS)
    mistral = Tokenizer(mistral_hf, bos_token_id=mistral_hf.token_to_id("<s>"),
                        eos_token_id=mistral_hf.token_to_id("</s>"))
    gemma_hf = train_byte_level_bpe(QWEN2_REGEX, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"])
    gemma = Tokenizer(gemma_hf, bos_token_id=gemma_hf.token_to_id("<bos>"), eos_token_id=gemma_hf.token_to_id("<eos>"))
    return {"qwen": qwen, "qwen_coder": qwen, "mistral": mistral, "llama3": llama, "json": gemma}


def template_turn(parser: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The assistant turn the family's published chat template writes for ``calls`` (Qwen3, Llama 3.1)."""
    tok = tokenizers()[parser]
    user = [{"role": "user", "content": "hi"}]
    msg: dict[str, Any] = {"role": "assistant", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)
    ]}
    if content is not None:
        msg["content"] = content
    before = tok.apply_chat_template(user, tools=TOOLS, add_generation_prompt=True)
    full = tok.apply_chat_template([*user, msg], tools=TOOLS, add_generation_prompt=False)
    assert full.startswith(before)
    turn = full[len(before):]
    if parser == "qwen":
        turn = turn.split("</think>\n\n", 1)[1].rsplit("<|im_end|>", 1)[0]
    return turn


def cases() -> dict[str, list[Case]]:
    """Realistic outputs per parser: one call, several, text around them, nested/unicode/escaped args."""
    return {
        "qwen": [
            Case("one", _hermes(PARIS), "", (PARIS,)),
            Case("template-two", template_turn("qwen", "Let me check both.", [PARIS, TOKYO]),
                 "Let me check both.", (PARIS, TOKYO)),
            Case("around-nested", "Searching now…\n\n" + _hermes(NESTED) + "\n" + _hermes(CALC) + "\nDone, waiting.",
                 "Searching now…\nDone, waiting.", (NESTED, CALC)),
            Case("template-escaped", template_turn("qwen", None, [ESCAPED]), "", (ESCAPED,)),
        ],
        "qwen_coder": [
            Case("one", _xml(TOKYO), "", (TOKYO,)),
            Case("around-two", "I'll look that up.\n\n" + _xml(NESTED) + "\n" + _xml(CALC) + "\nThen I will answer.",
                 "I'll look that up.\nThen I will answer.", (NESTED, CALC)),
            Case("escaped", "Writing the file:\n" + _xml(ESCAPED), "Writing the file:", (ESCAPED,)),
            Case("bare-one", _bare(PARIS), "", (PARIS,)),
            Case("bare-around-two", "Checking both.\n\n" + _bare(NESTED) + "\n" + _bare(CALC) + "\nBack soon.",
                 "Checking both.\nBack soon.", (NESTED, CALC)),
            Case("bare-then-wrapped", _bare(ESCAPED) + "\n" + _xml(TOKYO) + "\n", "", (ESCAPED, TOKYO)),
            Case("bare-stray-close", "Looking.\n" + _bare(TOKYO) + "\n</tool_call>\n" + _bare(PARIS) + "</tool_call>",
                 "Looking.", (TOKYO, PARIS)),
        ],
        "mistral": [
            Case("v3-one", "[TOOL_CALLS][" + _call_json(PARIS, "arguments") + "]", "", (PARIS,)),
            Case("v3-several", "Checking.[TOOL_CALLS] [" + _call_json(NESTED, "arguments") + ", "
                 + _call_json(TOKYO, "arguments") + "]", "Checking.", (NESTED, TOKYO)),
            Case("v11-args", "Let me compute that." + _v11(CALC) + _v11(ESCAPED), "Let me compute that.", (CALC, ESCAPED)),
            Case("v11-bare", _v11(TOKYO, "") + _v11(NESTED, "[CALL_ID]a1B2c3D4e[ARGS]") + " Done.", " Done.",
                 (TOKYO, NESTED)),
        ],
        "llama3": [
            Case("template-one", template_turn("llama3", None, [TOKYO]), "", (TOKYO,)),
            Case("tag-several", "<|python_tag|>" + _call_json(NESTED, "parameters") + "; "
                 + _call_json(PARIS, "arguments") + "<|eom_id|>", "", (NESTED, PARIS)),
            Case("around", "Let me calculate.\n" + _call_json(CALC, "parameters") + "\nThat is the call.",
                 "Let me calculate.\nThat is the call.", (CALC,)),
            Case("tag-escaped", "Saving it.<|python_tag|>" + _call_json(ESCAPED, "parameters"), "Saving it.",
                 (ESCAPED,)),
        ],
        "json": [
            Case("one", _call_json(PARIS, "arguments"), "", (PARIS,)),
            Case("list", "[" + _call_json(NESTED, "parameters") + ",\n " + _call_json(CALC, "parameters") + "]", "",
                 (NESTED, CALC)),
            Case("around", "Here is the call:\n" + _call_json(ESCAPED, "arguments") + "\nAnything else?",
                 "Here is the call:\nAnything else?", (ESCAPED,)),
            Case("not-a-call", "The result:\n{\"city\": \"Paris\", \"temp\": 21}\n[1, 2]",
                 "The result:\n{\"city\": \"Paris\", \"temp\": 21}\n[1, 2]", ()),
        ],
    }


@dataclass
class Result:
    """Everything a parser gave for one output."""

    content: str
    calls: list[ToolCall]
    deltas: list[ToolCallDelta]


def run(parser_name: str, pieces: list[str], tools: list[dict[str, Any]] | None = TOOLS) -> Result:
    """Push ``pieces`` one by one, then finish."""
    parser = make_parser(parser_name, tools)
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        text, ds = parser.push(piece)
        content.append(text)
        deltas += ds
    text, ds = parser.finish()
    return Result("".join(content) + text, parser.calls, deltas + ds)


def token_pieces(tok: Tokenizer, text: str) -> list[str]:
    """``text`` as the server sees it: encoded, then decoded one token at a time (special tokens kept)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    pieces = [detok.push(i) for i in tok.encode(text, add_special_tokens=False)]
    pieces.append(detok.flush())
    assert "".join(pieces) == text, "the tokenizer does not round-trip this text"
    return pieces


def random_pieces(text: str, seed: int) -> list[str]:
    """``text`` cut at seeded random points into pieces of 1 to 12 characters (some empty)."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        j = i + rng.choice((0, 1, 1, 2, 3, 5, 8, 12))
        out.append(text[i:j])
        i = j
    return out
