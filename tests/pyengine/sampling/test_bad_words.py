"""vLLM's bad_words rule (``sampling/bad_words.py``): which token sequences a word bans, and when."""

from __future__ import annotations

import pytest

from candle_vllm.pyengine.loader.embedded import default_model_path
from candle_vllm.pyengine.sampling import SamplingParams
from candle_vllm.pyengine.sampling.bad_words import bad_words_token_ids, banned_next
from candle_vllm.pyengine.tokenizer import Tokenizer
from candle_vllm.pyengine.tokenizer.gguf_vocab import load_tokenizer_from_gguf


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer_from_gguf(default_model_path())


def test_a_word_is_banned_bare_and_after_a_space(tokenizer: Tokenizer) -> None:
    """SmolLM2's BPE gives "sea" and " sea" different tokens: both forms are banned; the given word's own leading
    space is dropped first (vLLM strips it)."""
    bare, spaced = (tokenizer.encode(t, add_special_tokens=False) for t in ("seashore", " seashore"))
    assert bare[0] != spaced[0] and len(bare) == len(spaced)  # the case the rule adds the spaced form for
    assert bad_words_token_ids(["  seashore"], tokenizer) == [bare, spaced]
    with pytest.raises(ValueError, match="no tokens"):
        bad_words_token_ids([""], tokenizer)


def test_banned_next_needs_the_words_head_at_the_end() -> None:
    words = [[5], [1, 2, 3]]
    assert banned_next(words, []) == [5]
    assert banned_next(words, [9, 1, 2]) == [5, 3]
    assert banned_next(words, [1, 2, 9]) == [5]
    assert banned_next(words, [2]) == [5]


def test_only_words_of_several_tokens_wait_for_the_newest_token() -> None:
    """A one-token word is banned at every step whatever came before, so it keeps the step pipeline running; a
    longer word's ban reads the newest token (the runner collects the step in flight first)."""
    assert not SamplingParams(bad_words_token_ids=[[5], [9]]).bad_words_need_history
    assert SamplingParams(bad_words_token_ids=[[5], [1, 2]]).bad_words_need_history
    assert not SamplingParams().bad_words_need_history
