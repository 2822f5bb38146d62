"""The parser a model gets by default, from its family or from what its chat template teaches; the CLI
offers exactly the parsers that exist."""

from __future__ import annotations

import pytest
from tool_parser_fixtures import LLAMA31, QWEN3  # the published Qwen3 and Llama 3.1 templates

from candle_vllm.api.cli import TOOL_PARSERS, build_parser
from candle_vllm.api.tool_parsers import PARSER_NAMES, default_parser_name

QWEN3_CODER_TEMPLATE = ("{% for tool in tools %}...{% endfor %}<tool_call>\n<function=example_function_name>\n"
                        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>")
MISTRAL_TEMPLATE = "{%- if message.tool_calls %}{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' }}{% endif %}"

CASES = [
    ("Qwen3ForCausalLM", "Qwen/Qwen3-8B", QWEN3, "qwen"),
    ("Qwen2ForCausalLM", "Qwen/Qwen2.5-7B-Instruct", None, "qwen"),
    ("Qwen2ForCausalLM", "Qwen/Qwen2.5-Coder-7B-Instruct", None, "qwen"),  # Qwen2.5-Coder writes Hermes JSON
    ("qwen2", "qwen2.5-0.5b-instruct-q8_0.gguf", None, "qwen"),
    ("Qwen3MoeForCausalLM", "Qwen/Qwen3-Coder-30B-A3B-Instruct", None, "qwen_coder"),
    ("qwen3moe", "/models/Qwen3-Coder-30B-A3B-Instruct-Q4_K_M.gguf", None, "qwen_coder"),
    ("Qwen3_5MoeForConditionalGeneration", "Qwen/Qwen3.5-35B-A3B", None, "qwen_coder"),
    ("Qwen3ForCausalLM", "my-finetune", QWEN3_CODER_TEMPLATE, "qwen_coder"),
    ("QWenLMHeadModel", "Qwen/Qwen-14B-Chat", None, None),  # Qwen 1: no tool format of these
    ("MistralForCausalLM", "mistralai/Mistral-7B-Instruct-v0.3", None, "mistral"),
    ("llama", "Mistral-Small-3.2-24B-Instruct-2506-Q4_K_M.gguf", None, "mistral"),
    ("LlamaForCausalLM", "meta-llama/Llama-3.2-3B-Instruct", None, "llama3"),
    ("llama", "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", LLAMA31, "llama3"),
    ("Gemma3ForCausalLM", "google/gemma-3-4b-it", None, "json"),
    ("gemma2", "gemma-2-2b-it.Q4_K_M.gguf", None, "json"),
    ("LlamaForCausalLM", "HuggingFaceTB/SmolLM2-135M-Instruct", None, None),
    ("LlamaForCausalLM", "some/finetune", QWEN3, "qwen"),
    ("LlamaForCausalLM", "another/finetune", LLAMA31, "llama3"),
    ("Phi3ForCausalLM", "microsoft/Phi-3-mini", MISTRAL_TEMPLATE, "mistral"),
    ("Phi3ForCausalLM", "microsoft/Phi-3-mini", "{{ messages }}", None),
]


@pytest.mark.parametrize(("arch", "name", "template", "expected"), CASES)
def test_default_parser(arch: str, name: str, template: str | None, expected: str | None) -> None:
    assert default_parser_name(arch, name, template) == expected


def test_cli_offers_the_parsers_that_exist() -> None:
    assert TOOL_PARSERS == PARSER_NAMES == ("qwen", "qwen_coder", "json", "mistral", "llama3")
    action = next(a for a in build_parser()._actions if "--enforce-parser" in a.option_strings)
    assert tuple(action.choices) == PARSER_NAMES
