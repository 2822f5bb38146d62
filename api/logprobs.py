"""The two logprob shapes of the OpenAI API, built from the engine's per-token ``{token_id: Logprob}`` dicts.

Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
Completions: ``{tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}``, with echoed prompt
positions first (the first prompt token has no logprob: ``null``).
vLLM's ``prompt_logprobs``: per prompt position ``{"<token id>": {logprob, rank, decoded_token}}``.
With vLLM's ``return_tokens_as_token_ids`` a token's text is ``token_id:N``, which survives any detokenization.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from candle_vllm.api.token_bytes import TokenBytes
from candle_vllm.pyengine.outputs import Logprob

FLOOR = -9999.0  # OpenAI clients choke on -inf; vLLM clamps to this value too

TokenLogprobs = dict[int, Logprob]


def _text(token_id: int, lp: Logprob | None, tokenizer: Any, as_id: bool = False) -> str:
    if as_id:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.id_to_piece(token_id)


def _value(lp: Logprob | None) -> float:
    return FLOOR if lp is None else max(float(lp.logprob), FLOOR)


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely candidates of a position, most likely first."""
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]


class ChatLogprobs:
    """Builds ``choices[].logprobs.content`` items; ``bytes`` are each token's own bytes (``TokenBytes``), so
    the tokens of an emoji split over several tokens join back into the text, where their decoded strings are
    U+FFFD. One instance per server (it caches the bytes of every token it has shown)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)

    def content(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs], top_k: int,
                as_ids: bool = False) -> list[dict[str, Any]]:
        """One item per generated token id, with its ``top_k`` most likely candidates; ``as_ids`` names tokens
        ``token_id:N`` (their ``bytes`` stay the token's own, as vLLM's)."""
        items = []
        for tid, entry in zip(token_ids, entries, strict=False):
            tops = [{"token": _text(cand, lp, self.tokenizer, as_ids), "logprob": _value(lp),
                     "bytes": self.token_bytes(cand)}
                    for cand, lp in _top(entry, top_k)]
            items.append({"token": _text(tid, entry.get(tid), self.tokenizer, as_ids),
                          "logprob": _value(entry.get(tid)), "bytes": self.token_bytes(tid), "top_logprobs": tops})
        return items


class CompletionLogprobs:
    """Accumulates the completions-style logprobs of one choice, with running ``text_offset`` (over the token
    texts shown, ``token_id:N`` ones included, as vLLM counts)."""

    def __init__(self, top_k: int, tokenizer: Any, text_offset: int = 0, as_ids: bool = False) -> None:
        self.top_k = top_k
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None]) -> None:
        """Append positions; an entry of ``None`` (first prompt token) gives null logprob fields."""
        for tid, entry in zip(token_ids, entries, strict=False):
            lp = entry.get(tid) if entry is not None else None
            text = _text(tid, lp, self.tokenizer, self.as_ids)
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(_value(lp))
            top = {_text(c, clp, self.tokenizer, self.as_ids): _value(clp) for c, clp in _top(entry, self.top_k)}
            top.setdefault(text, _value(lp))  # the chosen token is always listed (k or k+1 entries)
            self.top_logprobs.append(top)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}

    def take(self) -> dict[str, Any]:
        """The positions added since the last ``take`` (for a stream chunk), clearing them."""
        out = self.to_json()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def prompt_logprobs_json(entries: Sequence[TokenLogprobs | None], top_k: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt position the prompt's own token and the ``top_k`` most likely
    ones (k or k + 1 entries; the engine may hold more when echo asked for more), keyed by token id, -inf
    clamped as vLLM clamps it; None for the first position, which nothing predicts."""
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        # The engine's entries hold the prompt token first, then the most likely ones ranked 1, 2, ...
        kept = [(tid, lp) for i, (tid, lp) in enumerate(entry.items()) if i == 0 or (lp.rank or 0) <= top_k]
        out.append({str(tid): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for tid, lp in kept})
    return out
