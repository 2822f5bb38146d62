"""The runner's grammar state: one llguidance matcher per constrained sequence, advanced by sampled tokens.

Where the state advances: the runner executes steps strictly in order and samples each step before the next
runs, even when the scheduler plans one step ahead with placeholder inputs. So the matcher of a sequence is
advanced right after the runner samples it, and the mask computed at the next step comes from a matcher
that has consumed every earlier token of that sequence. A preempted sequence keeps its matcher (its tokens
are recomputed as KV, never sampled again, so nothing is fed twice); a finished or aborted one releases it
when the plan lists it in ``finished_ids``. A token sampled after the grammar stopped (the wasted token of a
plan made before the EOS came back) is dropped by the scheduler and not fed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import llguidance
import llguidance.numpy
import numpy as np
import torch

from candle_vllm.pyengine.request import Request
from candle_vllm.pyengine.sampling.params import StructuredOutputParams
from candle_vllm.pyengine.sampling.token_mask import TokenMask
from candle_vllm.pyengine.structured_output.grammar import GrammarCompiler

log = logging.getLogger(__name__)

# Below this many constrained rows the masks are filled on the calling thread: a JSON-schema mask takes tens of
# microseconds, less than handing work to llguidance's thread pool (measured 0.14 ms serial vs 0.8 ms pooled
# for 8 rows of the SmolLM2 vocabulary).
PARALLEL_MASK_ROWS = 32


class GrammarMatchers:
    """Matchers of the constrained sequences one runner samples, by request id."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None
        self._bitmask = np.empty((0, 0), dtype=np.int32)  # reused across steps, grown on demand

    def __len__(self) -> int:
        return len(self._matchers)

    def admit(self, requests: Iterable[Request]) -> None:
        """Start a matcher for each constrained request not seen before (resumed ones keep theirs)."""
        for req in requests:
            params: StructuredOutputParams | None = getattr(req.sampling_params, "structured_output", None)
            if params is not None and req.request_id not in self._matchers:
                self._matchers[req.request_id] = self.compiler.new_matcher(params)

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def token_mask(self, requests: Sequence[Request]) -> tuple[list[int], TokenMask] | None:
        """Rows of ``requests`` (one sampled row each) that have a matcher, and their masks for this step;
        None when no row is constrained. The mask tensors are CPU views valid until the next call."""
        if not self._matchers:
            return None
        matchers = self._matchers
        rows = [i for i, req in enumerate(requests) if req.request_id in matchers]
        if not rows:
            return None
        words = self.compiler.mask_words
        if self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            self._bitmask = np.empty((max(len(rows), 2 * self._bitmask.shape[0]), words), dtype=np.int32)
        bitmask = self._bitmask[: len(rows)]
        if len(rows) < PARALLEL_MASK_ROWS:
            for k, i in enumerate(rows):
                llguidance.numpy.fill_next_token_bitmask(matchers[requests[i].request_id], bitmask, k)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(matchers[requests[i].request_id], k) for k, i in enumerate(rows)], bitmask)
        return rows, TokenMask(torch.tensor(rows, dtype=torch.int64), torch.from_numpy(bitmask))

    def advance(self, requests: Sequence[Request], rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Feed each constrained row's sampled token (``token_ids`` indexed by row) to its matcher."""
        for i in rows:
            matcher = self._matchers[requests[i].request_id]
            if matcher.is_stopped():
                continue
            if not matcher.consume_token(token_ids[i]):
                log.warning("request %s: the grammar rejected sampled token %d (%s); the output ends here",
                            requests[i].request_id, token_ids[i], matcher.get_error())
