"""KV cache sizing: budget precedence (--kv-fraction over --mem), the CPU cap, block counts, cache tensors."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from candle_vllm.pyengine.kv_cache import allocate_kv_caches, sizing


def test_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; f16 -> 2 * 30 * 3 * 64 * 2 bytes.
    assert sizing.kv_bytes_per_token(30, 3, 64, torch.float16) == 23040
    assert sizing.kv_bytes_per_token(30, 3, 64, torch.float32) == 46080


def test_fraction_wins_over_mem_and_the_cpu_default_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "host_available_bytes", lambda: 10 << 30)
    cpu = torch.device("cpu")
    assert sizing.kv_cache_budget_bytes(cpu, 0.1, 512) == (10 << 30) // 10
    assert sizing.kv_cache_budget_bytes(cpu, 0.9, None, cap_cpu=True) == sizing.CPU_KV_CAP_BYTES
    assert sizing.kv_cache_budget_bytes(cpu, 0.9, None) == int((10 << 30) * 0.9)  # the user's own fraction
    assert sizing.kv_cache_budget_bytes(cpu, None, 512) == 512 << 20
    with pytest.raises(ValueError, match="--kv-fraction"):
        sizing.kv_cache_budget_bytes(cpu, None, None)
    with pytest.raises(ValueError, match="--kv-fraction must be in"):
        sizing.kv_cache_budget_bytes(cpu, 1.5, None)


def test_cuda_fraction_uses_free_memory_uncapped(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # a CPU-only torch here
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def mem_get_info(device: torch.device | None = None) -> tuple[int, int]:
        calls.append("mem_get_info")
        return 100 << 30, 141 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert sizing.kv_cache_budget_bytes(torch.device("cuda", 0), 0.6, 4096) == int((100 << 30) * 0.6)
    assert calls == ["empty_cache", "mem_get_info"], "cached blocks must be released before free memory is read"


def test_host_available_bytes_reads_meminfo() -> None:
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert abs(sizing.host_available_bytes() - kib * 1024) < 256 << 20  # RAM moves a little between reads


def test_num_blocks_and_capacity_log(caplog: pytest.LogCaptureFixture) -> None:
    per_token = sizing.kv_bytes_per_token(30, 3, 64, torch.float16)
    with caplog.at_level(logging.INFO, logger=sizing.__name__):
        n = sizing.num_kv_blocks(100 << 20, 32, per_token)
    assert n == (100 << 20) // (32 * per_token)
    assert f"{n * 32} tokens" in caplog.text
    with pytest.raises(ValueError, match="--kv-fraction or --mem"):
        sizing.num_kv_blocks(1000, 32, per_token)


def test_cache_tensors_layout() -> None:
    caches = allocate_kv_caches(3, 10, 16, 2, 8, torch.float16, torch.device("cpu"))
    assert len(caches) == 3
    assert all(c.shape == (2, 10, 16, 2, 8) and c.dtype == torch.float16 for c in caches)
    assert caches[0].data_ptr() != caches[1].data_ptr()
    assert all(not c.any() for c in caches)
