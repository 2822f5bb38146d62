"""Log-probabilities of chosen tokens and their top-k alternatives, for sampled and prompt tokens.

They come from the model's raw logits (``log_softmax`` before logit_bias, penalties, temperature and
truncation): vLLM's default ("raw_logprobs"), and the only choice that means the same thing whatever
sampling settings a request used. Ranks count how many tokens are strictly more likely, plus one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from candle_vllm.pyengine.outputs import Logprob, TokenLogprobs


@dataclass(slots=True)
class LogprobsTensors:
    """Per position: the chosen token in column 0, then the ``K`` most likely tokens, best first."""

    token_ids: torch.Tensor  # int64 [N, 1 + K]
    logprobs: torch.Tensor  # f32 [N, 1 + K]
    ranks: torch.Tensor  # int64 [N], rank of the chosen token (1 = most likely)

    def tolists(self, num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
        """One host transfer, then per position the engine's ``{token_id: Logprob}``: the chosen token first,
        then its ``num_top[i]`` best alternatives (k or k + 1 entries, as vLLM); None where ``num_top[i]`` is.
        """
        ids = self.token_ids.cpu().tolist()
        lps = self.logprobs.cpu().tolist()
        ranks = self.ranks.cpu().tolist()
        out: list[TokenLogprobs | None] = []
        for row_ids, row_lps, rank, k in zip(ids, lps, ranks, num_top, strict=True):
            if k is None:
                out.append(None)
                continue
            entry = {row_ids[0]: Logprob(row_lps[0], rank)}
            for pos in range(k):
                entry.setdefault(row_ids[1 + pos], Logprob(row_lps[1 + pos], pos + 1))
            out.append(entry)
        return out


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Pick the chosen tokens' log-probabilities, ranks and the ``num_top`` best from [N, V] logprobs."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top = logprobs.topk(num_top, dim=-1)
        return LogprobsTensors(
            token_ids=torch.cat([token_ids[:, None], top.indices], dim=1),
            logprobs=torch.cat([chosen, top.values], dim=1),
            ranks=ranks,
        )
    return LogprobsTensors(token_ids=token_ids[:, None].clone(), logprobs=chosen, ranks=ranks)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Raw logprobs of ``token_ids`` [N] under ``logits`` [N, V] plus the ``num_top`` best per row."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, num_top)


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int, chunk_rows: int = 1024
) -> LogprobsTensors:
    """Logprobs of a prefill chunk's prompt tokens: row ``i`` of ``logits`` predicts ``next_token_ids[i]``.

    The caller passes the logits of the positions whose next prompt token is known (a prompt's last
    position predicts a generated token instead) and reports None for the first prompt token, as vLLM does.
    Works ``chunk_rows`` rows at a time so a long prefill needs no second [T, V] f32 buffer.
    """
    if logits.shape[0] != next_token_ids.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows but {next_token_ids.shape[0]} next tokens")
    parts = [
        compute_logprobs(
            logits[start : start + chunk_rows], next_token_ids[start : start + chunk_rows], num_top
        )
        for start in range(0, max(logits.shape[0], 1), chunk_rows)
    ]
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(
        token_ids=torch.cat([p.token_ids for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        ranks=torch.cat([p.ranks for p in parts]),
    )
