"""Streaming detokenization: turn generated ids into text deltas as they arrive.

Decoding one token at a time is wrong twice over: a token can hold part of a multi-byte character
(emoji, CJK under byte-level BPE), and SentencePiece decoders drop the leading space of the first
token they see. So each step decodes a short window -- a few already-emitted tokens as context plus
the pending ones -- and emits what the pending tokens add beyond the context's own text. Text ending
in U+FFFD (an incomplete character) is held back until the next token completes it. The window is
reset after every emission, so each step costs O(window) whatever the sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence

from candle_vllm.pyengine.tokenizer.base import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context for the first generated token (vLLM uses the same number).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Per-sequence decoder state; ``push`` each generated id, get the new text (often ``""``)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (held back while a character is split)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (an incomplete character shows as U+FFFD)."""
        text = self._decode(self._ids[self._prefix_offset :])
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _advance(self, text: str) -> str:
        # A character split where the window starts (the prompt's last bytes, given as ids) and completed by the
        # new tokens: its U+FFFD in the context's text became the character, which is emitted whole. U+FFFD the
        # new tokens leave standing (invalid bytes in the prompt) stays context.
        start = len(self._prefix_text)
        if not text.startswith(self._prefix_text):
            start = len(self._prefix_text.rstrip(_REPLACEMENT))
        delta = text[start:]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # Drop ids before the new window so memory stays bounded on long generations.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        self._prefix_text = self._decode(self._ids[: self._read_offset])
        return delta
