"""EngineArgs: the Rust CLI's defaults, device-dependent defaults, range checks and not-yet-supported refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from candle_vllm.pyengine.engine_args import (
    NOT_YET_SUPPORTED,
    EngineArgs,
    EngineConfigError,
    UnsupportedFeatureError,
    check_supported,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def test_defaults_match_reference_cli() -> None:
    a = EngineArgs()
    assert (a.prefill_chunk_size, a.master_port, a.num_nodes, a.node_rank) == (8192, 29500, 1, 0)
    assert (a.kvcache_dtype, a.load_format, a.max_num_seqs) == ("auto", "auto", 256)
    assert not (a.disable_prefix_cache or a.disable_cuda_graph or a.multithread or a.cpu)
    assert a.model is a.weight_path is a.weight_file is a.isq is a.max_gen_tokens is None


@pytest.mark.parametrize(("device", "kv_fraction", "block_size"), [(CUDA, 0.6, 64), (CPU, 0.4, 32)])
def test_device_dependent_defaults(device: torch.device, kv_fraction: float, block_size: int) -> None:
    r = EngineArgs().resolved(device)
    assert (r.kv_fraction, r.block_size) == (kv_fraction, block_size)
    explicit = EngineArgs(kv_fraction=0.25, block_size=16).resolved(device)
    assert (explicit.kv_fraction, explicit.block_size) == (0.25, 16)


def test_fixed_mem_budget_leaves_fraction_unset_unless_given() -> None:
    assert EngineArgs(mem=2048).resolved(CUDA).kv_fraction is None
    assert EngineArgs(mem=2048, kv_fraction=0.3).resolved(CUDA).kv_fraction == 0.3


def test_resolve_device_honours_cpu_flag() -> None:
    assert EngineArgs(cpu=True).resolve_device() == CPU
    assert EngineArgs(cpu=True).resolved().block_size == 32
    with pytest.raises(ValueError, match=r"--d 0 names a GPU and --cpu asks for none"):
        EngineArgs(cpu=True, device_ids=[0]).resolve_device()


def test_flags_without_effect_are_named() -> None:
    """No flag is silently ignored: --mem beside --kv-fraction, and the master address/port of one node."""
    assert EngineArgs().unused_flag_notes() == []
    assert EngineArgs(mem=100).unused_flag_notes() == []
    notes = EngineArgs(mem=100, kv_fraction=0.1, master_port=1234).unused_flag_notes()
    assert len(notes) == 2 and "--mem 100 has no effect" in notes[0] and "--master-addr" in notes[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_id_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"--d 1 needs a GPU.*--cpu"):
        EngineArgs(device_ids=[1]).resolve_device()


def test_max_gen_tokens_defaults_to_a_fifth_of_context() -> None:
    assert EngineArgs().max_gen_tokens_for(8192) == 1638
    assert EngineArgs().max_gen_tokens_for(3) == 1
    assert EngineArgs(max_gen_tokens=100).max_gen_tokens_for(8192) == 100


def test_torch_dtype() -> None:
    assert EngineArgs().torch_dtype(CUDA) is torch.bfloat16
    assert EngineArgs().torch_dtype(CPU) is torch.float32
    assert EngineArgs(dtype="f16").torch_dtype(CPU) is torch.float16


def test_sampling_defaults_only_lists_given_values() -> None:
    assert EngineArgs().sampling_defaults() == {}
    got = EngineArgs(temperature=0.7, top_k=20, presence_penalty=-1.5).sampling_defaults()
    assert got == {"temperature": 0.7, "top_k": 20, "presence_penalty": -1.5}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_fraction": 0.0}, r"--kv-fraction.*\(0\.0, 1\.0\]"),
        ({"kv_fraction": 1.01}, r"--kv-fraction"),
        ({"kv_fraction": "0.5"}, r"--kv-fraction.*'0.5'"),
        ({"frequency_penalty": 2.5}, r"--frequency-penalty.*\[-2\.0, 2\.0\]"),
        ({"presence_penalty": -2.01}, r"--presence-penalty"),
        ({"block_size": 48}, r"\(--block-size\) must be a power of two, got 48"),
        ({"block_size": 0}, r"--block-size"),
        ({"device_ids": [0, 1, 2]}, r"--d.*1, 2, 4, 8"),
        ({"device_ids": [1, 1]}, r"--d.*distinct"),
        ({"device_ids": [-1]}, r"--d.*non-negative"),
        ({"max_num_seqs": 0}, r"--max-num-seqs"),
        ({"max_num_seqs": 2.5}, r"--max-num-seqs.*integer"),
        ({"prefill_chunk_size": -1}, r"--prefill-chunk-size"),
        ({"temperature": -0.1}, r"--temperature"),
        ({"temperature": True}, r"--temperature"),
        ({"top_p": 0.0}, r"--top-p"),
        ({"top_k": -2}, r"--top-k"),
        ({"min_p": 1.5}, r"--min-p"),
        ({"seed": -1}, r"--seed"),
        ({"seed": 2**64}, r"--seed"),
        ({"yarn_scaling_factor": 0.5}, r"--yarn-scaling-factor"),
        ({"max_model_len": 0}, r"--max-model-len"),
        ({"mem": 0}, r"--mem"),
        ({"num_nodes": 0}, r"--num-nodes"),
        ({"node_rank": 1}, r"--node-rank.*below --num-nodes \(1\)"),
        ({"node_rank": -1}, r"--node-rank"),
        ({"master_port": 70000}, r"--master-port"),
        ({"dtype": "fp8"}, r"--dtype.*bf16, f16, f32"),
        ({"isq": "q9k"}, r"--isq.*q4k"),
        ({"kvcache_dtype": "fp4"}, r"--kvcache-dtype"),
        ({"load_format": "pt"}, r"--load-format.*auto, dummy"),
    ],
)
def test_invalid_values_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_fraction": 1.0},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0},
        {"top_k": -1},
        {"top_p": 1.0, "min_p": 0.0},
        {"block_size": 16},
        {"device_ids": [3]},
        {"seed": 0},
        {"prefill_chunk_size": 0},
        {"yarn_scaling_factor": 4.0},
        {"temperature": 0.0},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    args = EngineArgs(**kwargs)
    assert all(getattr(args, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"multithread": True}, "--multithread"),
        ({"num_nodes": 2, "node_rank": 1}, "--num-nodes 2"),
        ({"device_ids": [0, 1]}, "--d 0,1"),
    ],
)
def test_not_yet_supported_features_are_refused(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as info:
        EngineArgs(**kwargs)
    text = str(info.value)
    assert text.startswith(flag + " is not supported yet") and "\n" not in text


def test_refusal_table_skips_built_and_absent_fields() -> None:
    assert "enforce_parser" not in {p.field for p in NOT_YET_SUPPORTED}  # built: tool-call parsers
    check_supported({"enforce_parser": "qwen", "ui_server": True, "kvcache_dtype": "auto"})  # nothing refused
    with pytest.raises(UnsupportedFeatureError, match=r"^--multithread is not supported yet"):
        check_supported({"enforce_parser": "qwen", "multithread": True})


def test_from_kwargs_names_every_unknown_argument() -> None:
    with pytest.raises(TypeError) as info:
        EngineArgs.from_kwargs(model="m", kv_fractoin=0.5, bogus=1)
    assert "kv_fractoin (did you mean kv_fraction?)" in str(info.value) and "bogus" in str(info.value)
    assert EngineArgs.from_kwargs(model="m", max_num_seqs=4).max_num_seqs == 4


def test_from_namespace_ignores_server_entries() -> None:
    args = EngineArgs.from_namespace({"model": "x", "host": "127.0.0.1", "block_size": 16})
    assert (args.model, args.block_size) == ("x", 16)


def test_hf_token_from_env_var_or_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MY_HF_TOKEN", "hf_abc")
    assert EngineArgs(hf_token="MY_HF_TOKEN").hf_token_value() == "hf_abc"
    monkeypatch.delenv("MY_HF_TOKEN")
    with pytest.raises(ValueError, match="MY_HF_TOKEN is not set"):
        EngineArgs(hf_token="MY_HF_TOKEN").hf_token_value()
    token_file = tmp_path / "token"
    token_file.write_text("hf_xyz\n")
    assert EngineArgs(hf_token_path=str(token_file)).hf_token_value() == "hf_xyz"
    with pytest.raises(ValueError, match="no such file"):
        EngineArgs(hf_token_path=str(tmp_path / "missing")).hf_token_value()
    assert EngineArgs().hf_token_value() is None


def test_fp8_kv_cache_dtype_and_where_it_is_refused() -> None:
    """--kvcache-dtype fp8 gives an e4m3 cache on CUDA (f16/bf16 activations) and the CPU; f32 activations on CUDA
    and other devices are refused with a message naming the flag."""
    args = EngineArgs(kvcache_dtype="e4m3")
    assert args.kvcache_dtype == "fp8"
    assert args.cache_torch_dtype(torch.device("cuda"), torch.bfloat16) == torch.float8_e4m3fn
    assert args.cache_torch_dtype(torch.device("cpu"), torch.float32) == torch.float8_e4m3fn
    assert EngineArgs().cache_torch_dtype(torch.device("cuda"), torch.float16) == torch.float16
    with pytest.raises(EngineConfigError, match=r"--kvcache-dtype fp8 on CUDA needs f16/bf16 activations"):
        args.cache_torch_dtype(torch.device("cuda"), torch.float32)
    with pytest.raises(EngineConfigError, match=r"--kvcache-dtype fp8 needs a CUDA or CPU device, not mps"):
        args.cache_torch_dtype(torch.device("mps"), torch.float16)


@pytest.mark.parametrize(("given", "mode"), [("k8v4", "turbo8"), ("4bit", "turbo4"), ("turbo3", "turbo3")])
def test_turbo_kv_cache_dtypes_are_bytes_on_cuda_and_cpu(given: str, mode: str) -> None:
    """The TurboQuant modes are accepted (no longer refused as pending) and give a cache of uint8 rows on CUDA
    (f16/bf16 activations, which its kernels take) and the CPU; other devices are refused naming the flag."""
    args = EngineArgs(kvcache_dtype=given)
    assert args.kvcache_dtype == mode
    assert args.cache_torch_dtype(torch.device("cuda"), torch.bfloat16) == torch.uint8
    assert args.cache_torch_dtype(torch.device("cpu"), torch.float32) == torch.uint8
    with pytest.raises(EngineConfigError, match=rf"--kvcache-dtype {mode} on CUDA needs f16/bf16 activations"):
        args.cache_torch_dtype(torch.device("cuda"), torch.float32)
    with pytest.raises(EngineConfigError, match=rf"--kvcache-dtype {mode} needs a CUDA or CPU device, not mps"):
        args.cache_torch_dtype(torch.device("mps"), torch.float16)
