"""Structured-output params and schema checks: clear errors for unusable schemas (with and without a tokenizer),
one compiled grammar per distinct schema, and the sampling-parameter combinations that are refused."""

from __future__ import annotations

import math

import pytest

from candle_vllm.pyengine.sampling import SamplingParams
from candle_vllm.pyengine.sampling.params import StructuredOutputParams
from candle_vllm.pyengine.structured_output import check_structured_output, compiler_for
from candle_vllm.pyengine.tokenizer import Tokenizer

BAD_SCHEMAS = [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "Invalid type: strin"),
    ({"not": {"type": "string"}}, "Unimplemented keys"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "Unsatisfiable"),
    ({"type": "string", "pattern": "(a"}, "unclosed group"),
    ({"$ref": "#/$defs/missing"}, "does not exist"),
    ({"type": "string", "format": "not-a-format"}, "Unknown format"),
]


@pytest.mark.parametrize(("schema", "message"), BAD_SCHEMAS)
@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_unusable_schemas_raise_value_error(schema: dict, message: str, with_tokenizer: bool,
                                            smol_tokenizer: Tokenizer) -> None:
    params = StructuredOutputParams(json_schema=schema)
    with pytest.raises(ValueError, match="cannot be used for structured output") as info:
        check_structured_output(params, smol_tokenizer if with_tokenizer else None)
    assert message in str(info.value)


def test_one_grammar_per_distinct_schema(smol_tokenizer: Tokenizer) -> None:
    compiler = compiler_for(smol_tokenizer)
    assert compiler_for(smol_tokenizer) is compiler
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}, "required": ["x"]}
    before = len(compiler._templates)
    check_structured_output(StructuredOutputParams(json_schema=a), smol_tokenizer)
    first, second = (compiler.new_matcher(StructuredOutputParams(json_schema=dict(a))) for _ in range(2))
    assert len(compiler._templates) == before + 1
    ids = smol_tokenizer.encode('{"x":12,"y":"hi"}', add_special_tokens=False)
    assert first.consume_tokens(ids) and first.is_accepting()
    assert second.compute_bitmask() != first.compute_bitmask(), "each sequence has its own matcher state"
    check_structured_output(StructuredOutputParams(json_object=True), smol_tokenizer)
    assert len(compiler._templates) == before + 2


@pytest.mark.parametrize("order", [("reasoning", "answer"), ("answer", "reasoning")])
def test_properties_come_in_the_schema_order(order: tuple[str, str], smol_tokenizer: Tokenizer) -> None:
    """OpenAI's structured outputs write the properties in the schema's order (a "reasoning" field placed before
    "answer" is generated first), so schemas that differ only in key order are different grammars."""
    types = {"reasoning": {"type": "string"}, "answer": {"type": "integer"}}
    schema = {"type": "object", "properties": {k: types[k] for k in order}, "required": list(order),
              "additionalProperties": False}
    values = {"reasoning": '"two"', "answer": "2"}
    in_order = "{" + ",".join(f'"{k}":{values[k]}' for k in order) + "}"
    reversed_order = "{" + ",".join(f'"{k}":{values[k]}' for k in reversed(order)) + "}"
    compiler = compiler_for(smol_tokenizer)
    for text, accepted in ((in_order, True), (reversed_order, False)):
        matcher = compiler.new_matcher(StructuredOutputParams(json_schema=schema))
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        assert (matcher.consume_tokens(ids) and matcher.is_accepting()) == accepted, text


@pytest.mark.parametrize("kwargs", [{}, {"json_schema": {"type": "object"}, "json_object": True}])
def test_exactly_one_field(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams(**kwargs)


@pytest.mark.parametrize("schema", [["not", "an", "object"], {"type": "number", "maximum": math.nan},
                                    {"enum": [{1, 2}]}])
def test_schema_must_be_a_json_object(schema: object) -> None:
    with pytest.raises(ValueError, match="json_schema"):
        StructuredOutputParams(json_schema=schema)  # type: ignore[arg-type]


def test_sampling_params_refuse_conflicts() -> None:
    so = StructuredOutputParams(json_object=True)
    assert SamplingParams(structured_output=so, n=3).structured_output is so
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_output=so, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured_output=so, min_tokens=2)
    with pytest.raises(ValueError, match="StructuredOutputParams"):
        SamplingParams(structured_output={"json_object": True})
