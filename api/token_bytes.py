"""The real bytes of one token, for the ``bytes`` field of chat logprobs.

OpenAI sends ``bytes`` so that a client can join the tokens back into text when a token holds only part of a
UTF-8 character (an emoji or a CJK character is often two or three tokens). The decoded text of such a token is
U+FFFD, and its bytes say nothing, so the bytes come from the vocabulary entry instead:

- byte-level BPE (GPT-2, Llama-3, Qwen, SmolLM): each character of the entry stands for one byte, through
  GPT-2's ``bytes_to_unicode`` table;
- SentencePiece with byte fallback (Llama-2, Mistral): ``<0xNN>`` entries are one byte, and U+2581 is a space;
- added tokens (``<|im_end|>``, tool tags) and any other vocabulary: the UTF-8 of the token's decoded text.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SPACE = "\u2581"  # SentencePiece's visible space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: printable bytes map to themselves, the others to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def _decoder_types(hf: Any) -> set[str]:
    """The ``type`` of the tokenizer's decoder and of every decoder nested in it (a ``Sequence``)."""
    decoder = hf.decoder
    if decoder is None:
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(decoder.__getstate__()))
    return found


class TokenBytes:
    """``token_bytes(token_id)``: the bytes a token stands for (cached; one instance per tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        types = _decoder_types(tokenizer.hf)
        self._byte_level = "ByteLevel" in types
        self._sentencepiece = not self._byte_level and bool(types & {"ByteFallback", "Metaspace"})
        self._added = set(tokenizer.hf.get_added_tokens_decoder())
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = list(self._bytes(token_id))
        return cached

    def _bytes(self, token_id: int) -> bytes:
        piece = None if token_id in self._added else self._tokenizer.hf.id_to_token(token_id)
        if piece is not None and self._byte_level and all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        if piece is not None and self._sentencepiece:
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace(_SPACE, " ").encode()
        return self._tokenizer.id_to_piece(token_id).encode()
