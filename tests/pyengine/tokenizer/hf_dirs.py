"""Hugging Face style model directories (tokenizer.json + configs) built from tokenizers trained in tests."""

from __future__ import annotations

import json
from pathlib import Path

from chat_template_texts import LLAMA31, QWEN3
from tokenizer_fixtures import LLAMA3_REGEX, QWEN2_REGEX, train_byte_level_bpe
from tokenizers import processors

QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


def _write(path: Path, name: str, data: object) -> None:
    (path / name).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def qwen3_dir(path: Path) -> Path:
    """Qwen3-like: byte-level BPE without BOS, named chat templates in tokenizer_config, eos list in
    generation_config."""
    path.mkdir(parents=True, exist_ok=True)
    tok = train_byte_level_bpe(QWEN2_REGEX, QWEN3_SPECIALS)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(path / "tokenizer.json"))
    _write(path, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": [{"name": "default", "template": QWEN3},
                          {"name": "tool_use", "template": QWEN3.replace("# Tools", "# Tool use")}],
    })
    _write(path, "generation_config.json", {"eos_token_id": [tok.token_to_id("<|im_end|>"),
                                                              tok.token_to_id("<|endoftext|>")]})
    return path


def llama3_dir(path: Path) -> Path:
    """Llama-3-like: BOS added by tokenizer.json's post-processor, AddedToken-dict special tokens,
    chat_template.jinja overriding a stale tokenizer_config template."""
    path.mkdir(parents=True, exist_ok=True)
    tok = train_byte_level_bpe(LLAMA3_REGEX, LLAMA3_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    tok.save(str(path / "tokenizer.json"))
    added = {"__type": "AddedToken", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": True}
    _write(path, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"content": "<|begin_of_text|>", **added},
        "eos_token": {"content": "<|eot_id|>", **added},
        "chat_template": "{{ 'stale template' }}",
    })
    (path / "chat_template.jinja").write_text(LLAMA31, encoding="utf-8")
    _write(path, "generation_config.json", {"eos_token_id": [tok.token_to_id("<|end_of_text|>"),
                                                              tok.token_to_id("<|eom_id|>"),
                                                              tok.token_to_id("<|eot_id|>")]})
    return path
