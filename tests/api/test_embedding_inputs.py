"""How ``/v1/embeddings`` reads its inputs (``api/routes/embeddings.py``), on a real tokenizer that adds a BOS:
``add_special_tokens`` reaches the tokenizer, ``truncate_prompt_tokens`` cuts inputs, token ids and the context are
checked, and vLLM's extras that would change the vector are refused while their neutral values pass."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from candle_vllm.api.errors import APIError
from candle_vllm.api.prompts import refuse_unbuilt_extras
from candle_vllm.api.routes.embeddings import _UNBUILT, _token_ids
from candle_vllm.api.schemas import EmbeddingRequest
from candle_vllm.pyengine.tokenizer.hf import load_tokenizer_from_hf_dir

BOS = 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Word-level "w0 w1 ..." with "<s>" (id 1) put before every sequence by its post-processor."""
    path = tmp_path_factory.mktemp("bos_tokenizer")
    vocab = {"<unk>": 0, "<s>": BOS, **{f"w{i}": i + 2 for i in range(30)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.save(str(Path(path) / "tokenizer.json"))
    return load_tokenizer_from_hf_dir(path)


def test_add_special_tokens_reaches_the_tokenizer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    with_bos = _token_ids(EmbeddingRequest(input=["w0 w5", "w7"]), tokenizer, 64)
    without = _token_ids(EmbeddingRequest(input="w0 w5", add_special_tokens=False), tokenizer, 64)
    assert with_bos == [[BOS, 2, 7], [BOS, 9]] and without == [[2, 7]]
    assert _token_ids(EmbeddingRequest(input=[[5, 6]]), tokenizer, 64) == [[5, 6]]  # ids go in as they are


def test_ids_and_context_are_checked(tokenizer) -> None:  # type: ignore[no-untyped-def]
    for given, param in (([3, 999], "input"), ([[3], [3, 999]], "input.1")):
        with pytest.raises(APIError, match="outside the vocabulary") as info:
            _token_ids(EmbeddingRequest(input=given), tokenizer, 64)
        assert info.value.param == param
    with pytest.raises(APIError, match="embeds at most 3") as info:
        _token_ids(EmbeddingRequest(input=["w1", "w1 w2 w3"]), tokenizer, 4)  # 4 tokens with the BOS
    assert info.value.param == "input.1" and info.value.code == "context_length_exceeded"


def test_truncate_prompt_tokens_keeps_each_inputs_last_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """vLLM's ``truncate_prompt_tokens`` before the context check: the BOS goes with the start; -1 keeps what fits
    beside the internal token; more than the context, or 0, is a 400 naming the field."""
    req = EmbeddingRequest(input=["w0 w1 w2 w3", "w4"], truncate_prompt_tokens=2)
    assert _token_ids(req, tokenizer, 64) == [[4, 5], [BOS, 6]]
    for whole in (-1, 4):  # vLLM takes up to the context: here one less, the internal token's place
        assert _token_ids(EmbeddingRequest(input="w0 w1 w2 w3", truncate_prompt_tokens=whole), tokenizer, 4) == \
            [[3, 4, 5]]
    for keep, match in ((65, "greater than max_model_len"), (0, "must be -1")):
        with pytest.raises(APIError, match=match) as info:
            _token_ids(EmbeddingRequest(input="w0", truncate_prompt_tokens=keep), tokenizer, 64)
        assert info.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize(("extra", "refused"), [
    ({"endianness": "little"}, False), ({"endianness": "native"}, False), ({"endianness": "big"}, True),
    ({"normalize": True}, False), ({"normalize": False}, True),
    ({"embed_dtype": "float32"}, False), ({"embed_dtype": "bfloat16"}, True), ({"messages": []}, False),
])
def test_unbuilt_extras(extra: dict[str, object], refused: bool) -> None:
    req = EmbeddingRequest.model_validate({"input": "w1", **extra})
    if refused:
        with pytest.raises(APIError) as info:
            refuse_unbuilt_extras(req, _UNBUILT)
        assert info.value.param == next(iter(extra))
    else:
        refuse_unbuilt_extras(req, _UNBUILT)
