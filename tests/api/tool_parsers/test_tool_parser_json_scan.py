"""The incremental JSON checker agrees with ``json.loads`` on random documents, their prefixes and their
one-character corruptions, however the text is cut; it reports the top-level keys and string values."""

from __future__ import annotations

import json
import random
from typing import Any

from candle_vllm.api.tool_parsers.json_scan import DONE, ERROR, KEY_END, VALUE_END, VALUE_START, JsonScanner

_ALPHABET = 'abc xyz_-é中😀\\"\n\t/\x01'
_NOISE = '{}[]",:\\0123456789eE.+- tfnrulasx\n'


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.uniform(-1e6, 1e6) * 10.0 ** rng.randint(-30, 30)
    if kind in (3, 4):
        return "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(12)))
    if kind in (5, 6):
        return {f"k{rng.randrange(99)}{rng.choice(_ALPHABET)}": _value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _document(rng: random.Random) -> tuple[dict[str, Any], str]:
    obj = {f"key{i}{rng.choice(_ALPHABET)}": _value(rng, 1) for i in range(1 + rng.randrange(5))}
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]),
                      separators=rng.choice([None, (",", ":"), (" , ", " : ")]))
    return obj, text


def _scan(text: str, rng: random.Random) -> tuple[str, int, list[str], list[str]]:
    """("done" | "error" | "more", position, top-level keys, top-level string values), fed in random cuts."""
    scanner, keys, strings = JsonScanner(), [], []
    i, fed = 0, 0
    while fed < len(text):
        fed = min(len(text), fed + rng.randint(1, 9))
        piece = text[:fed]
        while i < fed:
            flags, i = scanner.scan(piece, i)
            if flags & ERROR:
                return "error", i, keys, strings
            if flags & KEY_END:
                keys.append(scanner.key)
            if flags & VALUE_END and piece[i - 1] == '"':
                strings.append(scanner.string)
            if flags & DONE:
                return "done", i, keys, strings
            assert flags & ~(VALUE_START | VALUE_END | KEY_END) == 0
    return "more", i, keys, strings


def _json_ok(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_documents_prefixes_and_corruptions() -> None:
    rng = random.Random(7)
    for _ in range(300):
        obj, text = _document(rng)
        status, pos, keys, strings = _scan(text, rng)
        assert (status, pos) == ("done", len(text))
        assert keys == list(obj)
        assert strings == [v for v in obj.values() if isinstance(v, str)]
        cut = rng.randrange(len(text))
        assert _scan(text[:cut], rng)[0] == "more"
        for _ in range(6):
            k = rng.randrange(len(text))
            op = rng.randrange(3)
            noise = rng.choice(_NOISE)
            bad = text[:k] + (noise if op < 2 else "") + text[k + (op != 1):]
            status, pos, _, _ = _scan(bad, rng)
            accepted = status == "done" and not bad[pos:].strip(" \t\n\r")
            assert accepted == _json_ok(bad), bad


def test_control_characters_and_numbers_as_strict_as_json_loads() -> None:
    rng = random.Random(1)
    for text in ('{"a": "\x1f"}', '{"a": 01}', '{"a": 1.}', '{"a": .5}', '{"a": -}', '{"a": 1e}', '{"a": +1}',
                 '{"a": "\\x"}', '{"a": "\\u12G4"}', '{"a": tru}', '{"a": nul}', '{"a": 1,}', '{,}', '[1,]',
                 '{"a": [1 2]}', '{"a" 1}', '{"a": 1e+5, "b": -0.0E-2, "c": "\\u00e9\\ud83d\\ude00"}'):
        status, pos, _, _ = _scan(text, rng)
        assert (status == "done" and pos == len(text)) == _json_ok(text), text
