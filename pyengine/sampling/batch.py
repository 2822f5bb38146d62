"""One step's sampling parameters, packed per row into tensors on the logits' device.

Every row of a step may belong to a different request, so nothing here is batch-wide: each parameter is a
tensor with one entry per row (or a sparse list of (row, token) pairs). Work a batch does not need (no row
uses top-p, no row has penalties, ...) is marked None so the sampler skips it.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from candle_vllm.pyengine.ops.transfer import to_device
from candle_vllm.pyengine.sampling.bad_words import banned_next
from candle_vllm.pyengine.sampling.params import SamplingParams
from candle_vllm.pyengine.sampling.token_mask import TokenMask


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The private random stream of a seeded request; keep it with the request across steps.

    For ``n > 1`` give each choice its own stream (e.g. seed + choice index), else the choices coincide.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits: its request's params, the tokens so far, and the request's generator."""

    params: SamplingParams
    output_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None  # required when params.seed is set


@dataclass(slots=True)
class Penalties:
    """Repetition/frequency/presence penalties for the rows (``rows``) that have any."""

    rows: torch.Tensor  # int64 [P], indices into the batch
    repetition: torch.Tensor  # f32 [P]
    frequency: torch.Tensor  # f32 [P]
    presence: torch.Tensor  # f32 [P]
    output_counts: torch.Tensor  # f32 [P, V], occurrences of each token in the generated output
    seen: torch.Tensor | None  # bool [P, V], token in prompt or output; None when no repetition penalty


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling inputs for one step; build with :meth:`build`."""

    vocab_size: int
    greedy: torch.Tensor | None  # bool [B]; None when every row is greedy (nothing to tell apart)
    all_greedy: bool
    any_greedy: bool
    any_unseeded_random: bool  # some row draws from the sampler's shared stream
    temperature: torch.Tensor | None  # f32 [B], 1.0 on greedy rows; None when every row is greedy
    top_k: torch.Tensor | None  # int64 [B], 0 = disabled
    max_top_k: int
    top_k_on_every_row: bool  # every sampled (non-greedy) row has a top-k: sort only max_top_k per row
    top_p: torch.Tensor | None  # f32 [B]
    min_p: torch.Tensor | None  # f32 [B]
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, biases)
    # (rows with allowed_token_ids, and (index into those rows, token id) pairs): every other token is -inf there
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (rows, token ids) set to -inf: stop tokens before min_tokens, the tokens that would complete a bad word
    banned: tuple[torch.Tensor, torch.Tensor] | None
    penalties: Penalties | None
    generators: list[torch.Generator | None]  # per row; None = the sampler's shared stream
    num_logprobs: list[int | None]  # per row: top-k count requested, None = no logprobs
    max_num_logprobs: int | None
    token_mask: TokenMask | None = None  # grammar masks of the constrained rows (structured output)

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Collection[int] = (),
        token_mask: TokenMask | None = None,
    ) -> SamplingBatch:
        """Pack ``rows`` for logits with ``vocab_size`` columns on ``device``.

        ``eos_token_ids`` are the model's own stop tokens (tokenizer.stop_token_ids); with each request's
        stop_token_ids they are banned while a row has produced fewer than ``min_tokens`` tokens.
        ``token_mask`` holds the grammar masks of the rows constrained by structured output (moved to
        ``device`` here).
        """
        device = torch.device(device)
        params = [row.params for row in rows]
        greedy = [p.is_greedy for p in params]
        random_params = [p for p in params if not p.is_greedy]
        top_k, top_k_on_every_row = _top_k(params, vocab_size)
        generators = [_row_generator(i, row, device) for i, row in enumerate(rows)]
        requested = [p.logprobs for p in params if p.logprobs is not None]

        def per_row(values: list[float] | list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype), device)

        all_greedy = not random_params
        return cls(
            vocab_size=vocab_size,
            greedy=None if all_greedy else per_row(greedy, torch.bool),
            all_greedy=all_greedy,
            any_greedy=any(greedy),
            any_unseeded_random=any(p.seed is None for p in random_params),
            temperature=None if all_greedy
            else per_row([1.0 if p.is_greedy else p.temperature for p in params], torch.float32),
            top_k=per_row(top_k, torch.int64) if any(top_k) else None,
            max_top_k=max(top_k, default=0),
            top_k_on_every_row=top_k_on_every_row,
            top_p=per_row([p.top_p for p in params], torch.float32)
            if any(p.top_p < 1.0 for p in random_params)
            else None,
            min_p=per_row([p.min_p for p in params], torch.float32)
            if any(p.min_p > 0.0 for p in random_params)
            else None,
            logit_bias=_logit_bias(params, vocab_size, device),
            allowed=_allowed(params, vocab_size, device),
            banned=_banned(rows, vocab_size, eos_token_ids, device),
            penalties=_penalties(rows, vocab_size, device),
            generators=generators,
            num_logprobs=[p.logprobs for p in params],
            max_num_logprobs=max(requested) if requested else None,
            token_mask=None if token_mask is None else token_mask.to(device),
        )


def _top_k(params: Sequence[SamplingParams], vocab_size: int) -> tuple[list[int], bool]:
    """Per-row top-k (0 = none) and whether every sampled row has one."""

    def effective(p: SamplingParams) -> int:
        return p.top_k if p.top_k < vocab_size else 0  # a top-k covering the vocabulary is no top-k

    on_every_row = all(effective(p) for p in params if not p.is_greedy) and not all(
        p.is_greedy for p in params
    )
    # Greedy rows never use their value; top-1 (the same as greedy) keeps the "every row" fast path open.
    greedy_value = 1 if on_every_row else 0
    return [greedy_value if p.is_greedy else effective(p) for p in params], on_every_row


def _row_generator(index: int, row: SamplingRow, device: torch.device) -> torch.Generator | None:
    if row.params.seed is None or row.params.is_greedy:
        return None
    if row.generator is None:
        raise ValueError(
            f"row {index} has seed={row.params.seed} but no generator; create it once per request "
            "with make_generator(seed, device) and pass it every step"
        )
    if row.generator.device.type != device.type:
        raise ValueError(f"row {index}: generator is on {row.generator.device}, logits are on {device}")
    return row.generator


def _logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return None
    tokens = [t for p in params for t in p.logit_bias]
    if max(tokens) >= vocab_size:
        raise ValueError(
            f"logit_bias token id {max(tokens)} is outside the vocabulary (size {vocab_size}); "
            "validate requests with SamplingParams.check_vocab"
        )
    biases = [b for p in params for b in p.logit_bias.values()]
    return (
        to_device(torch.tensor(rows, dtype=torch.int64), device),
        to_device(torch.tensor(tokens, dtype=torch.int64), device),
        to_device(torch.tensor(biases, dtype=torch.float32), device),
    )


def _allowed(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    pairs = [(k, t) for k, i in enumerate(rows) for t in params[i].allowed_token_ids or ()]
    if max(t for _, t in pairs) >= vocab_size:
        raise ValueError(f"allowed_token_ids reach past the vocabulary (size {vocab_size}); validate requests "
                         "with SamplingParams.check_vocab")
    indices = to_device(torch.tensor(pairs, dtype=torch.int64), device)
    return to_device(torch.tensor(rows, dtype=torch.int64), device), indices[:, 0], indices[:, 1]


def _banned(
    rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: Collection[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stop ids (request's + model's) of rows short of min_tokens (ids past the vocabulary are moot), and the
    tokens that would complete a row's bad word."""
    pairs = [
        (i, t)
        for i, row in enumerate(rows)
        if len(row.output_token_ids) < row.params.min_tokens
        for t in sorted(set(row.params.stop_token_ids) | set(eos_token_ids))
        if t < vocab_size
    ]
    pairs += [(i, t) for i, row in enumerate(rows) if row.params.bad_words_token_ids
              for t in banned_next(row.params.bad_words_token_ids, row.output_token_ids)]
    if not pairs:
        return None
    indices = to_device(torch.tensor(pairs, dtype=torch.int64), device)
    return indices[:, 0], indices[:, 1]


def _penalties(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> Penalties | None:
    picked = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not picked:
        return None
    chosen = [rows[i] for i in picked]
    uses_repetition = any(row.params.repetition_penalty != 1.0 for row in chosen)

    def floats(name: str) -> torch.Tensor:
        return to_device(torch.tensor([getattr(row.params, name) for row in chosen], dtype=torch.float32), device)

    output_counts = _token_counts([row.output_token_ids for row in chosen], vocab_size, device)
    seen = None
    if uses_repetition:
        seen = output_counts > 0
        seen[_flat_indices([row.prompt_token_ids for row in chosen], vocab_size, device)] = True
    return Penalties(
        rows=to_device(torch.tensor(picked, dtype=torch.int64), device),
        repetition=floats("repetition_penalty"),
        frequency=floats("frequency_penalty"),
        presence=floats("presence_penalty"),
        output_counts=output_counts,
        seen=seen,
    )


def _flat_indices(
    sequences: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of every token of every sequence, for scatter-style updates of [N, V]."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    total = int(lengths.sum())
    tokens = torch.from_numpy(
        np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=total)
    )
    if total and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}) to apply penalties")
    rows = torch.repeat_interleave(torch.arange(len(sequences)), lengths)
    return to_device(rows, device), to_device(tokens, device)


def _token_counts(sequences: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """f32 [len(sequences), vocab_size]: how often each token occurs in each sequence."""
    counts = torch.zeros(len(sequences), vocab_size, dtype=torch.float32, device=device)
    rows, tokens = _flat_indices(sequences, vocab_size, device)
    counts.index_put_((rows, tokens), torch.ones(len(tokens), device=device), accumulate=True)
    return counts
