"""Scheduler limits, resolved once from the engine flags so the per-step code only reads plain ints."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFILL_CHUNK = 8192
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of the scheduling policy.

    ``prefill_chunk_size`` caps the prompt tokens one request computes per step (0 disables chunking: a
    prompt is prefilled in one step). ``max_num_batched_tokens`` is the per-step token budget shared by all
    requests; by default the chunk size (at least ``max_num_seqs``, so every running request can decode),
    or, without chunking, enough for the longest prompt.
    """

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    prefix_cache_max_tokens: int | None = None
    scheduling_policy: str = "fcfs"  # vLLM's: "fcfs", or "priority" (requests' priority, then arrival)

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_chunk_size < 0:
            raise ValueError(f"prefill_chunk_size must be >= 0 (0 disables chunking), got {self.prefill_chunk_size}")
        if self.max_num_batched_tokens is None:
            budget = (max(self.prefill_chunk_size, self.max_num_seqs) if self.chunked_prefill
                      else max(self.max_model_len, DEFAULT_PREFILL_CHUNK))
            object.__setattr__(self, "max_num_batched_tokens", budget)
        elif self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        elif not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off (prefill_chunk_size=0) a prompt is prefilled in one step, so "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}); raise it or enable chunking with --prefill-chunk-size")

    @property
    def chunked_prefill(self) -> bool:
        return self.prefill_chunk_size > 0

    @property
    def token_budget(self) -> int:
        """The resolved per-step budget (``max_num_batched_tokens`` after defaults)."""
        assert self.max_num_batched_tokens is not None
        return self.max_num_batched_tokens

    @property
    def max_blocks_per_seq(self) -> int:
        return min(self.num_blocks, -(-self.max_model_len // self.block_size))


def kv_room(kv_tokens: int, prompt_len: int) -> int:
    """Tokens one request may generate after a prompt of ``prompt_len`` in a cache of ``kv_tokens``: every generated
    token but the last (never fed back) needs a slot, as the scheduler counts it."""
    return kv_tokens - prompt_len + 1


def default_max_tokens(default: int, prompt_len: int, max_model_len: int, kv_tokens: int | None) -> int:
    """The ``max_tokens`` of a request that set none: the default (``--max-gen-tokens``) cut to what fits after its
    prompt, in the context and in the KV cache (None: not known), and at least 1. A client that never sent
    ``max_tokens`` cannot lower it, so refusing the request for the default would leave it no way to succeed."""
    limit = min(default, max_model_len - prompt_len)
    if kv_tokens is not None:
        limit = min(limit, kv_room(kv_tokens, prompt_len))
    return max(1, limit)
