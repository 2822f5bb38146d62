"""``TokenBytes``: a token's own bytes, so the tokens of a character split over several tokens join back into it.

Checked on the real SmolLM2 tokenizer (byte-level BPE) and on a SentencePiece-style vocabulary with byte
fallback; the expected bytes are the UTF-8 of the text the ids were encoded from, never the code under test.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from candle_vllm.api.token_bytes import TokenBytes
from candle_vllm.pyengine.tokenizer import Tokenizer

TEXTS = [" Hello 🙂 你好世界", "naïve\n\t日本語テスト", "🌟🌟"]


def _joined(tb: TokenBytes, ids: list[int]) -> bytes:
    return b"".join(bytes(tb(i)) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_join_back_into_the_text(smol_tokenizer: Tokenizer, text: str) -> None:
    tb = TokenBytes(smol_tokenizer)
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in smol_tokenizer.id_to_piece(i)]
    assert partial, "the text must hold a character split over tokens (their decoded text is U+FFFD)"
    assert all(bytes(tb(i)) != "\ufffd".encode() for i in partial)
    assert _joined(tb, ids) == text.encode()


def test_added_tokens_are_their_text(smol_tokenizer: Tokenizer) -> None:
    tb = TokenBytes(smol_tokenizer)
    end = smol_tokenizer.token_to_id("<|im_end|>")
    assert end is not None and bytes(tb(end)) == b"<|im_end|>"


def _sentencepiece() -> Tokenizer:
    """A Llama-2-style vocabulary: words with U+2581 for spaces, and ``<0xNN>`` byte tokens for the rest."""
    words = ["<unk>", "\u2581", "h", "i", "\u2581h", "\u2581hi"]
    vocab = {**{w: i for i, w in enumerate(words)}, **{f"<0x{b:02X}>": len(words) + b for b in range(256)}}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "h"), ("\u2581h", "i")], unk_token="<unk>",
                                fuse_unk=True, byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return Tokenizer(hf, bos_token_id=None, eos_token_id=None)


def test_sentencepiece_byte_fallback_tokens_are_one_byte_each() -> None:
    tok = _sentencepiece()
    tb = TokenBytes(tok)
    text = " hi 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.hf.id_to_token(ids[0]) == "\u2581hi" and len(ids) > 3
    assert _joined(tb, ids) == text.encode()
