"""Small real-ish tokenizers for tests: trained here on a fixed corpus, written as GGUF with the gguf package.

The vocabularies are trained by libraries we did not write (``tokenizers``, ``sentencepiece``); the GGUF
files follow what llama.cpp's converter writes, so llama.cpp (vocab_only) can load them as an oracle.
"""

from __future__ import annotations

import io
from pathlib import Path

import gguf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024; don't you think we'll ship v3.14 soon?",
    "Numbers: 0 1 12 123 1234 12345 3.14159 1,000,000 and -42. Phone +1 (555) 010-9999.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }\t// tabs\tand  double  spaces",
    "URLs like https://example.com/path?query=1&x=y#frag and emails a.b@c.org appear.",
    "Unicode: café naïve façade Ünïcödé Ω≈ç√∫ — “quotes” and ‘single’ ones… done.",
    "中文文本测试，你好世界！日本語のテキスト、こんにちは。한국어 텍스트 안녕하세요.",
    "Emoji: 😀 😃 👍🏽 🎉 👨‍👩‍👧 🚀 and flags 🇫🇷 mixed with text.",
    "Whitespace runs:    four spaces\n\n\ntwo newlines\r\nwindows line\t\ttwo tabs   ",
    "Привет мир, это тест. Γειά σου Κόσμε. مرحبا بالعالم. שלום עולם.",
    "I'M SHOUTING, YOU'RE WHISPERING, THEY'VE LEFT, SHE'S HERE, WE'D GO, HE'LL STAY.",
] * 3

TEST_TEXTS = [
    "Hello world",
    "  leading spaces\n\n\ttabs\t\t and   runs    ",
    "数字 12345 and 3.14159, 1,000,000",
    "emoji 😀👍🏽 family 👨‍👩‍👧 rocket🚀",
    "你好，世界！こんにちは 안녕하세요",
    "def f(x):\n    return x**2  # comment\n",
    "https://example.com/path?q=1&r=two#frag",
    "don't you'll I'M we've THEY'RE",
    "Ünïcödé façade naïve Ω≈ç√∫ — “quoted”",
    "\n\n\n   \n",
    " ",
    "unseen chars: ☃ ∮ 𝔘𝔫𝔦 ጀ",
    "mixed\r\nline\rends\n",
]

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def train_byte_level_bpe(split_regex: str, specials: list[str], vocab_size: int = 700) -> Tokenizer:
    """A byte-level BPE tokenizer with the given split regex, trained on CORPUS (as the model authors' would be)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def train_sentencepiece(vocab_size: int = 800) -> bytes:
    """A Llama-style SentencePiece BPE model (byte fallback, identity normalisation, split digits)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=out,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        add_dummy_prefix=True,
        user_defined_symbols=["<tool>"],
        minloglevel=2,
    )
    return out.getvalue()


def write_gguf(
    path: Path,
    *,
    model: str,
    tokens: list[str],
    token_types: list[int],
    pre: str | None = None,
    scores: list[float] | None = None,
    merges: list[str] | None = None,
    bos: int | None = None,
    eos: int | None = None,
    unk: int | None = None,
    add_bos: bool | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a weight-less GGUF holding only a vocabulary (plus the hparams llama.cpp insists on)."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for value, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id), (unk, w.add_unk_token_id)):
        if value is not None:
            add(value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_level_gguf(path: Path, tok: Tokenizer, pre: str, bos: str, eos: str, add_bos: bool) -> Path:
    """GGUF of a trained byte-level BPE tokenizer, laid out as llama.cpp's converter does."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    types = [int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens]
    merges = [" ".join(pair) for pair in _merges_of(tok)]
    return write_gguf(
        path, model="gpt2", pre=pre, tokens=tokens, token_types=types, merges=merges,
        bos=vocab[bos], eos=vocab[eos], add_bos=add_bos,
    )


def _merges_of(tok: Tokenizer) -> list[tuple[str, str]]:
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def sentencepiece_gguf(path: Path, model_proto: bytes) -> Path:
    """GGUF of a SentencePiece model: pieces, scores and piece types as llama.cpp's converter writes them."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()  # type: ignore[attr-defined]  # protobuf builds the class at import time
    proto.ParseFromString(model_proto)
    kinds = {1: gguf.TokenType.NORMAL, 2: gguf.TokenType.UNKNOWN, 3: gguf.TokenType.CONTROL,
             4: gguf.TokenType.USER_DEFINED, 5: gguf.TokenType.UNUSED, 6: gguf.TokenType.BYTE}
    pieces = list(proto.pieces)
    return write_gguf(
        path, model="llama", tokens=[p.piece for p in pieces], token_types=[int(kinds[p.type]) for p in pieces],
        scores=[p.score for p in pieces], bos=1, eos=2, unk=0, add_bos=True,
    )
