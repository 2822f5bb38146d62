"""vLLM's ``bad_words``: words the output must never contain, as token sequences banned at their last token.

A word is tokenized twice, as written and after a space (a word inside the text starts with one), vLLM's rule: the
spaced form counts only when its first token differs from the bare form's and it has as many tokens. A word of one
token is banned at every step; a longer one only where the output already ends with all its tokens but the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Encoder(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def bad_words_token_ids(words: Sequence[str], tokenizer: _Encoder) -> list[list[int]]:
    """The token sequences of ``words`` (each bare and, where it tokenizes as another word, after a space)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad_words entry {word!r} has no tokens")
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    bad = sorted({t for ids in out for t in ids if not 0 <= t < tokenizer.vocab_size})
    if bad:
        raise ValueError(f"bad_words token ids {bad[:5]} are outside the vocabulary (size {tokenizer.vocab_size})")
    return out


def banned_next(sequences: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete one of ``sequences`` after ``output_token_ids``."""
    banned = []
    for ids in sequences:
        head = len(ids) - 1
        if head == 0 or (len(output_token_ids) >= head and list(output_token_ids[-head:]) == list(ids[:-1])):
            banned.append(ids[-1])
    return banned
