"""Typed values from raw parameter text, by the tool's JSON schema (for the XML format of Qwen3-Coder).

The model writes every parameter as bare text; the tool's schema says what it means. Non-string types are
tried in a fixed order (null, boolean, integer, number, object, array) among those the schema allows --
through ``type`` (a name or a list), ``anyOf``/``oneOf``, ``enum`` or ``const`` -- and the text stays a
string when none fits, so the tool sees what the model wrote rather than a guess.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any

_INTEGER = re.compile(r"[+-]?\d+")
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}
_FAIL = object()


def schema_types(schema: dict[str, Any] | None) -> set[str]:
    """The JSON types a schema allows (empty: it does not say)."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out |= schema_types(sub)
    members = list(schema.get("enum") or []) + ([schema["const"]] if "const" in schema else [])
    out |= {_JSON_TYPES.get(type(m), "string") for m in members}
    return out


def _null(text: str) -> Any:
    return None if text in ("null", "None") else _FAIL


def _boolean(text: str) -> Any:
    return {"true": True, "false": False}.get(text.lower(), _FAIL)


def _integer(text: str) -> Any:
    return int(text) if _INTEGER.fullmatch(text) else _FAIL


def _number(text: str) -> Any:
    if _INTEGER.fullmatch(text):
        return int(text)
    try:
        value = float(text)
    except ValueError:
        return _FAIL
    return value if math.isfinite(value) else _FAIL


def _container(kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError:
            try:
                value = ast.literal_eval(text)  # Python literals: single quotes, True/False/None
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return _FAIL
        return value if isinstance(value, kind) else _FAIL

    return convert


_CONVERTERS: tuple[tuple[str, Callable[[str], Any]], ...] = (
    ("null", _null), ("boolean", _boolean), ("integer", _integer), ("number", _number),
    ("object", _container(dict)), ("array", _container(list)),
)


def convert_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """The value ``raw`` stands for under ``schema`` (None or untyped: a string)."""
    types = schema_types(schema)
    text = raw.strip()
    for name, convert in _CONVERTERS:
        if name in types:
            value = convert(text)
            if value is not _FAIL:
                return value
    return raw
