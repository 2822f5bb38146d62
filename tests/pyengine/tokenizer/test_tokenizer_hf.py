"""tokenizer.json directories must load like transformers' AutoTokenizer: same ids, text, special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_dirs import llama3_dir, qwen3_dir
from tokenizer_fixtures import TEST_TEXTS
from transformers import AutoTokenizer

from candle_vllm.pyengine.tokenizer import load_tokenizer_from_hf_dir

TEXTS = [*TEST_TEXTS, "<|im_start|>user\n<think>x</think><|im_end|>", "<|begin_of_text|>a<|eot_id|>b"]


@pytest.mark.parametrize("make", [qwen3_dir, llama3_dir])
def test_matches_auto_tokenizer(tmp_path: Path, make) -> None:
    path = make(tmp_path / "model")
    ours, ref = load_tokenizer_from_hf_dir(path), AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == ref.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert ours.vocab_size == len(ref)
    assert ours.special_tokens == ref.special_tokens_map
    assert ours.add_bos == (ref.encode("x")[0] == ref.bos_token_id)


def test_qwen3_dir_stop_ids_and_named_templates(tmp_path: Path) -> None:
    ours = load_tokenizer_from_hf_dir(qwen3_dir(tmp_path / "q"))
    assert ours.stop_token_ids == {ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")}
    assert set(ours.chat_templates) == {"default", "tool_use"}
    assert not ours.add_bos and ours.bos_token_id is None


def test_llama3_dir_jinja_file_wins_and_eos_list(tmp_path: Path) -> None:
    ours = load_tokenizer_from_hf_dir(llama3_dir(tmp_path / "l"))
    assert ours.chat_template is not None and ours.chat_template.startswith("{{- bos_token }}")
    assert ours.stop_token_ids == {ours.token_to_id(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")}
    assert ours.add_bos and ours.encode("hi")[0] == ours.bos_token_id


@pytest.mark.parametrize("add_bos", [True, False])
def test_add_bos_flag_builds_missing_post_processor(tmp_path: Path, add_bos: bool) -> None:
    path = qwen3_dir(tmp_path / "q")
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", add_bos_token=add_bos)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = load_tokenizer_from_hf_dir(path), AutoTokenizer.from_pretrained(str(path))
    bos = [ref.convert_tokens_to_ids("<|endoftext|>")] if add_bos else []
    assert ours.encode("hello") == bos + ref.encode("hello", add_special_tokens=False)
    assert ours.add_bos == add_bos


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_tokenizer_from_hf_dir(tmp_path)
