"""Engine arguments (contract D): one typed, validated field per engine CLI flag.

`candle-vllm` and `LLM(model=..., **kwargs)` both build an `EngineArgs`, so a value is checked once, with the
same message, however it arrives. Defaults that depend on the device (`--kv-fraction`, `--block-size`) stay
`None` until `resolved()` knows the device. Features not built yet are listed in `NOT_YET_SUPPORTED`, the one
place later work deletes entries from as features land.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from candle_vllm.pyengine.scheduler.config import SCHEDULING_POLICIES

KV_CACHE_DTYPES: dict[str, str] = {
    "auto": "auto",
    "fp8": "fp8",
    "e4m3": "fp8",
    "turbo8": "turbo8",
    "k8v4": "turbo8",
    "turbo4": "turbo4",
    "4bit": "turbo4",
    "turbo3": "turbo3",
    "k3v4": "turbo3",
}  # accepted spelling -> canonical name
ISQ_TYPES: tuple[str, ...] = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2k", "q3k", "q4k", "q5k", "q6k")
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
LOAD_FORMATS: tuple[str, ...] = ("auto", "dummy")
MASTER_PORT_DEFAULT = 29500

# Flags whose name is not `--` + the field name with dashes.
FLAG_NAMES: dict[str, str] = {
    "model": "--m",
    "weight_path": "--w",
    "weight_file": "--f",
    "device_ids": "--d",
    "host": "--h",
    "port": "--p",
}


def flag_name(field: str) -> str:
    """The CLI spelling of a field, for messages that must make sense to CLI and Python users alike."""
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


class UnsupportedFeatureError(NotImplementedError):
    """A flag asks for a feature that is not built yet: refused loudly instead of silently ignored."""


class EngineConfigError(ValueError):
    """Flag values that fail only once the model is loaded (a KV cache budget that holds no block): the CLI
    prints the message in one line and exits 2, as for any bad flag."""


@dataclass(frozen=True)
class PendingFeature:
    """A feature not built yet: the field that asks for it and the values that count as asking."""

    field: str
    feature: str
    in_use: Callable[[Any], bool]


NOT_YET_SUPPORTED: tuple[PendingFeature, ...] = (
    PendingFeature("multithread", "multi-threaded tensor parallelism", bool),
    PendingFeature("num_nodes", "multi-node inference", lambda v: v > 1),
    PendingFeature(
        "device_ids", "tensor parallelism over several devices", lambda v: v is not None and len(v) > 1
    ),
)


def check_supported(values: Mapping[str, Any]) -> None:
    """Raise `UnsupportedFeatureError` (one-line message naming the flag) for the first pending feature asked for.

    `values` maps field names to values; fields it lacks are skipped, so engine and server settings share
    the one table.
    """
    for pending in NOT_YET_SUPPORTED:
        if pending.field in values and pending.in_use(values[pending.field]):
            value = values[pending.field]
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            given = flag_name(pending.field) + ("" if isinstance(value, bool) else f" {shown}")
            raise UnsupportedFeatureError(
                f"{given} is not supported yet ({pending.feature} is not built); remove it"
            )


def _check_number(
    values: Mapping[str, Any],
    field: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    integer: bool = False,
) -> None:
    value = values[field]
    if value is None:
        return
    kinds = (int,) if integer else (int, float)
    bad = isinstance(value, bool) or not isinstance(value, kinds)
    bad = (
        bad
        or not math.isfinite(value)
        or (lo is not None and (value <= lo if lo_open else value < lo))
        or (hi is not None and value > hi)
    )
    if bad:
        left = "(" if lo_open else "["
        span = f"{left}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{field} ({flag_name(field)}) must be {kind} in {span}, got {value!r}")


def _check_choice(field: str, value: Any, choices: Mapping[str, Any] | tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise ValueError(f"{field} ({flag_name(field)}) must be one of {', '.join(choices)}; got {value!r}")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(kw_only=True)
class EngineArgs:
    """Everything that shapes the engine, named like the CLI flags, defaults equal to the CLI's."""

    # model
    model: str | None = None
    weight_path: str | None = None
    weight_file: str | None = None
    dtype: str | None = None
    isq: str | None = None
    load_format: str = "auto"
    hf_token: str | None = None
    hf_token_path: str | None = None
    yarn_scaling_factor: float | None = None
    hf_overrides: dict[str, Any] | None = None  # laid over config.json (vLLM's --hf-overrides)
    max_model_len: int | None = None
    # engine and cache
    cpu: bool = False
    kvcache_dtype: str = "auto"
    kv_fraction: float | None = None
    mem: int | None = None
    block_size: int | None = None
    max_num_seqs: int = 256
    prefill_chunk_size: int = 8192
    disable_prefix_cache: bool = False
    prefix_cache_max_tokens: int | None = None
    scheduling_policy: str = "fcfs"  # vLLM's: "priority" serves requests by their priority, then arrival
    disable_cuda_graph: bool = False
    seed: int | None = None
    # sampling defaults (override generation_config.json)
    max_gen_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # parallelism
    device_ids: list[int] | None = None
    multithread: bool = False
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = MASTER_PORT_DEFAULT

    def __post_init__(self) -> None:
        if self.kvcache_dtype in KV_CACHE_DTYPES:
            self.kvcache_dtype = KV_CACHE_DTYPES[self.kvcache_dtype]
        if self.device_ids is not None:
            self.device_ids = list(self.device_ids)
        self._validate()
        check_supported(vars(self))

    def _validate(self) -> None:
        v = vars(self)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("isq", self.isq, ISQ_TYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("kvcache_dtype", self.kvcache_dtype, KV_CACHE_DTYPES)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _check_number(v, "yarn_scaling_factor", 1.0, lo_open=True)
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides (--hf-overrides) must be a JSON object (a dict), got {self.hf_overrides!r}")
        _check_number(v, "max_model_len", 1, integer=True)
        _check_number(v, "kv_fraction", 0.0, 1.0, lo_open=True)
        _check_number(v, "mem", 1, integer=True)
        _check_number(v, "block_size", 1, 1024, integer=True)
        if self.block_size is not None and not _is_power_of_two(self.block_size):
            raise ValueError(f"block_size (--block-size) must be a power of two, got {self.block_size}")
        _check_number(v, "max_num_seqs", 1, integer=True)
        _check_number(v, "prefill_chunk_size", 0, integer=True)
        _check_number(v, "prefix_cache_max_tokens", 0, integer=True)
        _check_number(v, "seed", 0, 2**64 - 1, integer=True)
        _check_number(v, "max_gen_tokens", 1, integer=True)
        _check_number(v, "temperature", 0.0)
        _check_number(v, "top_p", 0.0, 1.0, lo_open=True)
        _check_number(v, "top_k", -1, integer=True)
        _check_number(v, "min_p", 0.0, 1.0)
        _check_number(v, "frequency_penalty", -2.0, 2.0)
        _check_number(v, "presence_penalty", -2.0, 2.0)
        _check_number(v, "num_nodes", 1, integer=True)
        _check_number(v, "node_rank", 0, integer=True)
        if self.node_rank >= self.num_nodes:
            raise ValueError(
                f"node_rank (--node-rank) must be below --num-nodes ({self.num_nodes}), got {self.node_rank}"
            )
        _check_number(v, "master_port", 1, 65535, integer=True)
        ids = self.device_ids
        if ids is not None:
            if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                raise ValueError(f"device_ids (--d) must be non-negative integers like 0,1; got {ids!r}")
            if len(set(ids)) != len(ids) or not _is_power_of_two(len(ids)):
                raise ValueError(f"device_ids (--d) must name 1, 2, 4, 8... distinct devices; got {ids!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments, naming every unknown one (with the nearest valid names) at once."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            hints = [
                f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, known, 1)) else k
                for k in unknown
            ]
            raise TypeError(f"unknown engine argument(s): {', '.join(hints)}")
        return cls(**kwargs)

    @classmethod
    def from_namespace(cls, values: Mapping[str, Any]) -> EngineArgs:
        """Build from parsed CLI values (e.g. `vars(argparse.Namespace)`), ignoring non-engine entries."""
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    def resolve_device(self) -> torch.device:
        """The device the engine runs on: CPU with `--cpu` or without a GPU, else the first `--d` GPU."""
        first = (self.device_ids or [0])[0]
        if self.cpu:
            if self.device_ids is not None:
                raise ValueError(f"--d {first} names a GPU and --cpu asks for none; pass one of them")
            return torch.device("cpu")
        if torch.cuda.is_available():
            if first >= torch.cuda.device_count():
                raise ValueError(f"--d {first}: only {torch.cuda.device_count()} CUDA device(s) are visible")
            return torch.device("cuda", first)
        mps = torch.backends.mps.is_available()
        if self.device_ids is not None and (first != 0 or not mps):
            raise ValueError(f"--d {first} needs a GPU and none is visible; omit --d or pass --cpu")
        return torch.device("mps") if mps else torch.device("cpu")

    def unused_flag_notes(self) -> list[str]:
        """Flags that were given but have no effect with the others (logged as warnings, so none is silently
        ignored): ``--mem`` beside ``--kv-fraction`` (which wins), the master address/port of one node."""
        notes = []
        if self.mem is not None and self.kv_fraction is not None:
            notes.append(f"--mem {self.mem} has no effect: --kv-fraction {self.kv_fraction} sizes the KV cache "
                         "(pass only one of them)")
        if self.num_nodes == 1 and (self.master_addr or self.master_port != MASTER_PORT_DEFAULT):
            notes.append("--master-addr / --master-port have no effect with one node (--num-nodes 1)")
        return notes

    def resolved(self, device: torch.device | None = None) -> EngineArgs:
        """A copy with the device-dependent defaults filled in: `--kv-fraction` 0.6 on CUDA, 0.4 elsewhere
        (left unset when only `--mem` is given, so the fixed budget applies), `--block-size` 64 on CUDA,
        32 elsewhere."""
        cuda = (device or self.resolve_device()).type == "cuda"
        kv_fraction = self.kv_fraction
        if kv_fraction is None and self.mem is None:
            kv_fraction = 0.6 if cuda else 0.4
        block_size = self.block_size if self.block_size is not None else (64 if cuda else 32)
        return dataclasses.replace(self, kv_fraction=kv_fraction, block_size=block_size)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The activation dtype: `--dtype` if given, else bf16 on CUDA and f32 elsewhere (CPU bf16 matmuls
        are slow without AMX, and f32 keeps CPU results closest to the reference)."""
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def cache_torch_dtype(self, device: torch.device, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type: the activation dtype, e4m3 with `--kvcache-dtype fp8` (half the bytes of
        bf16, so twice the tokens and half the attention traffic; values saturate at +-448, scale 1.0), or bytes
        of TurboQuant rows with turbo8/4/3 (``kv_cache/turbo.py``)."""
        if self.kvcache_dtype == "auto":
            return dtype
        if device.type not in ("cuda", "cpu"):
            raise EngineConfigError(f"--kvcache-dtype {self.kvcache_dtype} needs a CUDA or CPU device, not "
                                    f"{device.type}; remove it")
        if device.type == "cuda" and dtype == torch.float32:
            raise EngineConfigError(f"--kvcache-dtype {self.kvcache_dtype} on CUDA needs f16/bf16 activations; use "
                                    "--dtype bf16 or f16")
        return torch.float8_e4m3fn if self.kvcache_dtype == "fp8" else torch.uint8

    def max_gen_tokens_for(self, max_model_len: int) -> int:
        """Per-response output cap: `--max-gen-tokens`, else a fifth of the model's context."""
        return self.max_gen_tokens if self.max_gen_tokens is not None else max(1, max_model_len // 5)

    def sampling_defaults(self) -> dict[str, Any]:
        """Server-wide sampling defaults that were set; they override the model's generation_config.json."""
        names = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def hf_token_value(self) -> str | None:
        """The Hugging Face token: from the env var named by `--hf-token`, else the `--hf-token-path` file,
        else None (huggingface_hub then uses its own cached login)."""
        if self.hf_token is not None:
            token = os.environ.get(self.hf_token)
            if not token:
                raise ValueError(
                    f"--hf-token {self.hf_token}: environment variable {self.hf_token} is not set"
                )
            return token
        if self.hf_token_path is not None:
            path = Path(self.hf_token_path).expanduser()
            if not path.is_file():
                raise ValueError(f"--hf-token-path {self.hf_token_path}: no such file")
            return path.read_text().strip() or None
        return None
