"""Scheduler policy without a model: a fake paged "model" stores each token id as its KV at the planned slot and
derives the next token from the whole context read back through the plan's block table. Any wrong block
table, slot, position, prefix hit, fork or token lost to preemption changes the generated ids, which are
compared with generating from the plain token list (no paging at all)."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from candle_vllm.pyengine.request import FinishReason, Request, RequestStatus
from candle_vllm.pyengine.sampling import SamplingParams
from candle_vllm.pyengine.scheduler import RequestRejected, Scheduler, SchedulerConfig, StepPlan
from candle_vllm.pyengine.scheduler.config import default_max_tokens

VOCAB = 1000
_WEIGHTS = np.random.default_rng(0).integers(1, 1000, size=8192)


def next_token(context: np.ndarray, salt: int) -> int:
    return int(((context * _WEIGHTS[: len(context)]).sum() + 7919 * salt) % VOCAB)


def reference_output(prompt: list[int], max_tokens: int, salt: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(max_tokens):
        ctx.append(next_token(np.array(ctx), salt))
    return ctx[len(prompt):]


def salt_of(req: Request) -> int:
    return int(req.request_id.rsplit("-", 1)[-1])


class FakePagedModel:
    """Executes plans in submission order, as a device stream would."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv = np.full(num_blocks * block_size, -999, dtype=np.int64)
        self.kv_pos = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.last: dict[str, int] = {}

    def step(self, plan: StepPlan) -> list[int]:
        ids = plan.input_ids.copy()
        qsl = plan.query_start_loc
        for i, req in enumerate(plan.requests):
            holes = np.flatnonzero(ids[qsl[i]:qsl[i + 1]] == -1)
            if holes.size:  # a token sampled by a step whose result the scheduler has not seen yet
                assert holes.tolist() == [qsl[i + 1] - qsl[i] - 1]
                ids[qsl[i + 1] - 1] = self.last[req.request_id]
        no_rows: list[list[int]] = [[]]
        assert (plan.positions == np.concatenate(
            [np.arange(s, s + n) for s, n in zip(plan.start_positions, plan.num_new_tokens, strict=True)]
            or no_rows)).all()
        self.kv[plan.slot_mapping] = ids
        self.kv_pos[plan.slot_mapping] = plan.positions
        out = []
        for k, row in enumerate(plan.sample_indices.tolist()):
            i = int(np.searchsorted(qsl, row, side="right")) - 1
            req = plan.requests[i]
            assert req is plan.sampled_requests[k] and row == qsl[i + 1] - 1
            n = int(plan.seq_lens[i])
            slots = (plan.block_tables[i, :, None] * self.bs + np.arange(self.bs)).ravel()[:n]
            assert (self.kv_pos[slots] == np.arange(n)).all(), "context read back at wrong positions"
            tok = next_token(self.kv[slots], salt_of(req))
            self.last[req.request_id] = tok
            out.append(tok)
        return out


def make_requests(n: int, seed: int, shared: int = 24, max_tokens: tuple[int, int] = (40, 120)) -> list[Request]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(shared)]
    return [Request(f"r-{i}", system + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))],
                    SamplingParams(max_tokens=rng.randrange(*max_tokens), ignore_eos=True))
            for i in range(n)]


def drive(s: Scheduler, model: FakePagedModel, one_step_behind: bool = False,
          on_plan: Callable[[StepPlan], None] | None = None, max_steps: int = 100_000) -> int:
    """Run to completion; with ``one_step_behind`` each plan is made before the previous step's result is
    applied (the executor pipelined one step behind). Returns the number of steps."""
    inflight: tuple[StepPlan, list[int]] | None = None
    steps = 0
    while s.has_unfinished_requests():
        plan = s.schedule()
        if on_plan is not None:
            on_plan(plan)
        toks = model.step(plan)
        if one_step_behind:
            if inflight is not None:
                s.update(*inflight)
            inflight = (plan, toks)
        else:
            s.update(plan, toks)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def assert_all_blocks_free(s: Scheduler) -> None:
    kv = s.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_open_rows == 0
    assert all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))


@pytest.mark.parametrize("one_step_behind", [False, True])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_keeps_outputs_identical(one_step_behind: bool, prefix_cache: bool) -> None:
    bs = 8
    results = {}
    for num_blocks in (4000, 4 * 25):  # unconstrained; then a cache for ~4 of these sequences
        cfg = SchedulerConfig(num_blocks=num_blocks, block_size=bs, max_model_len=512, max_num_seqs=32,
                              prefill_chunk_size=32, enable_prefix_caching=prefix_cache)
        s = Scheduler(cfg)
        reqs = make_requests(32, seed=1)
        for r in reqs:
            s.add_request(r)
        drive(s, FakePagedModel(num_blocks, bs), one_step_behind)
        assert all(r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH for r in reqs)
        for r in reqs:
            assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens, salt_of(r))
        results[num_blocks] = ({r.request_id: r.output_token_ids for r in reqs},
                               sum(r.num_preemptions for r in reqs))
        assert_all_blocks_free(s)
    assert results[4000][1] == 0 and results[100][1] > 0
    assert results[4000][0] == results[100][0]


def test_prefix_hit_recomputes_last_token_and_shares_blocks() -> None:
    bs = 16
    s = Scheduler(SchedulerConfig(num_blocks=400, block_size=bs, max_model_len=4096))
    model = FakePagedModel(400, bs)
    prompt = [random.Random(2).randrange(VOCAB) for _ in range(1000)]
    first = Request("a-0", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    s.add_request(first)
    drive(s, model)
    second = Request("b-1", [*prompt, 5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    third = Request("c-2", list(prompt), SamplingParams(max_tokens=5, ignore_eos=True))
    s.add_request(second)
    s.add_request(third)
    plan = s.schedule()
    assert second.num_cached_tokens == 992 and third.num_cached_tokens == 992
    assert plan.num_new_tokens == [1003 - 992, 1000 - 992]
    shared = s.kv.row_blocks(second.kv_row)[:62]
    assert shared == s.kv.row_blocks(third.kv_row)[:62]
    assert all(s.kv.ref_count(b) == 2 for b in shared)
    s.update(plan, model.step(plan))
    drive(s, model)
    for r in (second, third):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 5, salt_of(r))
    assert s.prefix_hit_tokens == 2 * 992


@pytest.mark.parametrize("one_step_behind", [False, True])
def test_a_failed_step_leaves_no_unwritten_blocks_in_the_prefix_cache(one_step_behind: bool) -> None:
    """A step that raised wrote no KV: aborting its requests (the engine's answer to a failed step) must not
    publish their blocks, or the next request with that prompt reuses never-written KV. Pipelined, the next plan
    is made before the failed step's result, and it must not publish them either."""
    bs = 8
    prompt = [random.Random(5).randrange(VOCAB) for _ in range(40)]
    for fail in (True, False):
        s = Scheduler(SchedulerConfig(num_blocks=64, block_size=bs, max_model_len=256))
        model = FakePagedModel(64, bs)
        first = Request("a-0", list(prompt), SamplingParams(max_tokens=5, ignore_eos=True))
        s.add_request(first)
        plans = [s.schedule()]
        if one_step_behind:
            plans.append(s.schedule())  # the next step, planned while the first runs
        if fail:
            s.abort(first.request_id)
        else:
            for plan, toks in [(p, model.step(p)) for p in plans]:
                s.update(plan, toks)
            drive(s, model)
        second = Request("b-1", list(prompt), SamplingParams(max_tokens=5, ignore_eos=True))
        s.add_request(second)
        drive(s, model)
        assert second.num_cached_tokens == (0 if fail else 32)
        assert second.output_token_ids == reference_output(prompt, 5, salt_of(second))
        assert_all_blocks_free(s)


def test_random_aborts_free_every_block() -> None:
    bs = 8
    rng = random.Random(3)
    s = Scheduler(SchedulerConfig(num_blocks=120, block_size=bs, max_model_len=600, max_num_seqs=16,
                                  prefill_chunk_size=24))
    model = FakePagedModel(120, bs)
    reqs = make_requests(1000, seed=4, max_tokens=(400, 480))  # long: almost all are aborted first
    states: dict[str, int] = {"waiting": 0, "prefill": 0, "decode": 0, "preempted": 0}
    pending = list(reqs)
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                s.add_request(pending.pop(0))
        live = list(s.requests.values())
        for victim in rng.sample(live, min(len(live), rng.choice([0, 1, 1, 2]))):
            if victim.status is RequestStatus.RUNNING:
                states["prefill" if victim.num_computed_tokens < victim.num_prompt_tokens else "decode"] += 1
            else:
                states[victim.status.value] += 1
            assert s.abort(victim.request_id) is victim
        plan = s.schedule()
        s.update(plan, model.step(plan))
    aborted = sum(r.finish_reason is FinishReason.ABORT for r in reqs)
    assert aborted == sum(states.values()) >= 990
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs if r.finish_reason is not FinishReason.ABORT)
    assert states["prefill"] > 0 and states["decode"] > 0
    assert states["waiting"] > 0
    assert_all_blocks_free(s)
    assert s.abort("r-0") is None


def test_chunked_prefill_respects_budget_and_mixes_steps() -> None:
    bs, budget, chunk = 8, 64, 32
    s = Scheduler(SchedulerConfig(num_blocks=1000, block_size=bs, max_model_len=1024, max_num_seqs=8,
                                  prefill_chunk_size=chunk, max_num_batched_tokens=budget))
    reqs = make_requests(8, seed=5, shared=100, max_tokens=(10, 30))
    for r in reqs:
        s.add_request(r)
    mixed = 0

    def check(plan: StepPlan) -> None:
        nonlocal mixed
        assert plan.num_tokens <= budget
        decoding = [n for r, n in zip(plan.requests, plan.num_new_tokens, strict=True) if r.output_token_ids]
        prefilling = [n for r, n in zip(plan.requests, plan.num_new_tokens, strict=True) if not r.output_token_ids]
        assert all(n <= chunk for n in prefilling) and all(n == 1 for n in decoding)
        mixed += bool(decoding and prefilling)

    drive(s, FakePagedModel(1000, bs), on_plan=check)
    assert mixed > 0
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens, salt_of(r))


def test_chunking_off_prefills_whole_prompt_in_one_step() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=200, block_size=8, max_model_len=300, prefill_chunk_size=0))
    assert s.config.token_budget >= 300
    r = Request("x-0", list(range(1, 251)), SamplingParams(max_tokens=3))
    s.add_request(r)
    plan = s.schedule()
    assert plan.num_new_tokens == [250] and plan.sampled_requests == [r]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(num_blocks=200, block_size=8, max_model_len=300, prefill_chunk_size=0,
                        max_num_batched_tokens=256)


def test_max_num_seqs_bounds_the_batch() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=1000, block_size=8, max_model_len=512, max_num_seqs=3))
    reqs = make_requests(10, seed=6, max_tokens=(5, 15))
    for r in reqs:
        s.add_request(r)

    def check(plan: StepPlan) -> None:
        assert len(plan.requests) <= 3 and s.num_running <= 3

    drive(s, FakePagedModel(1000, 8), on_plan=check)
    assert all(r.is_finished for r in reqs)


def test_fork_shares_prompt_blocks_and_outputs_diverge() -> None:
    bs = 8
    s = Scheduler(SchedulerConfig(num_blocks=200, block_size=bs, max_model_len=512, prefill_chunk_size=16,
                                  enable_prefix_caching=False))
    prompt = [random.Random(7).randrange(VOCAB) for _ in range(45)]
    sp = SamplingParams(n=3, max_tokens=12, ignore_eos=True)
    family = [Request("f-0", prompt, sp)] + [Request(f"f-{i}", prompt, sp, fork_of="f-0") for i in (1, 2)]
    for r in family:
        s.add_request(r)
    seen_shared = 0

    def check(plan: StepPlan) -> None:
        nonlocal seen_shared
        if all(r.kv_row >= 0 for r in family):
            blocks = [s.kv.row_blocks(r.kv_row)[:5] for r in family]
            assert blocks[0] == blocks[1] == blocks[2]
            assert all(s.kv.ref_count(b) == 3 for b in blocks[0])
            seen_shared += 1

    drive(s, FakePagedModel(200, bs), on_plan=check)
    assert seen_shared > 0
    assert [r.num_cached_tokens for r in family] == [0, 40, 40]
    outs = [r.output_token_ids for r in family]
    assert outs[0] != outs[1] != outs[2]
    for r in family:
        assert r.output_token_ids == reference_output(prompt, 12, salt_of(r))
    assert_all_blocks_free(s)


def test_rejects_requests_that_can_never_fit() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=10, block_size=8, max_model_len=512))
    fits = Request("ok-0", list(range(1, 61)), SamplingParams(max_tokens=21))  # 80 KV tokens = 10 blocks
    s.add_request(fits)
    with pytest.raises(RequestRejected, match=r"--kv-fraction or --mem") as err:
        s.add_request(Request("big-1", list(range(1, 61)), SamplingParams(max_tokens=22)))
    assert "holds 80 tokens" in str(err.value)
    with pytest.raises(RequestRejected, match="context is 512 tokens"):
        s.add_request(Request("long-2", [1] * 512, SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(Request("ok-0", [1], SamplingParams(max_tokens=1)))


def _scripted(params: SamplingParams, script: list[int], eos: frozenset[int] = frozenset({2})) -> Request:
    """Feed ``script`` as the sampled tokens of one request until it finishes."""
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_model_len=256))
    r = Request("s-0", [5, 6, 7], params, eos_token_ids=eos)
    s.add_request(r)
    for tok in script:
        if r.is_finished:
            break
        plan = s.schedule()
        s.update(plan, [tok])
    assert_all_blocks_free(s) if r.is_finished else None
    return r


def test_stop_conditions() -> None:
    r = _scripted(SamplingParams(max_tokens=10), [9, 2, 9])
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == ([9, 2], FinishReason.STOP, None)
    r = _scripted(SamplingParams(max_tokens=4, ignore_eos=True), [2, 2, 2, 2, 2])
    assert (r.output_token_ids, r.finish_reason) == ([2, 2, 2, 2], FinishReason.LENGTH)
    r = _scripted(SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[11]), [2, 11, 9])
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == ([2, 11], FinishReason.STOP, 11)
    r = _scripted(SamplingParams(max_tokens=10, min_tokens=3), [2, 2, 2, 9])
    assert (r.output_token_ids, r.finish_reason) == ([2, 2, 2], FinishReason.STOP)
    r = _scripted(SamplingParams(max_tokens=None), [9] * 300)
    assert len(r.output_token_ids) == 253 and r.finish_reason is FinishReason.LENGTH  # context 256 - prompt 3


def test_text_stop_between_steps_frees_blocks_and_drops_inflight_result() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_model_len=256))
    model = FakePagedModel(100, 4)
    r = Request("t-0", list(range(1, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    s.add_request(r)
    p1 = s.schedule()
    t1 = model.step(p1)
    p2 = s.schedule()  # planned while step 1 is in flight: a placeholder for its token
    assert p2.input_ids.tolist() == [-1] and r.num_placeholders == 2
    t2 = model.step(p2)
    s.update(p1, t1)
    assert s.finish("t-0", FinishReason.STOP, "</s>") is r
    assert s.update(p2, t2) == []
    assert r.output_token_ids == t1 and r.stop_reason == "</s>"
    assert_all_blocks_free(s)
    assert s.schedule().finished_ids == ["t-0"]


@pytest.mark.parametrize("num_blocks,prompt_len", [(10, 60), (10, 79), (10, 80), (64, 100), (4, 1)])
def test_default_max_tokens_is_the_most_the_scheduler_admits(num_blocks: int, prompt_len: int) -> None:
    """The default for a request without ``max_tokens`` (the server's and the offline engine's rule) is admitted,
    and where the KV cache cut it, one more token is refused: the scheduler's own count is the oracle."""
    bs, max_model_len, default = 8, 512, 400
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=bs, max_model_len=max_model_len)
    limit = default_max_tokens(default, prompt_len, max_model_len, num_blocks * bs)
    prompt = [1 + i % 50 for i in range(prompt_len)]
    s = Scheduler(cfg)
    s.add_request(Request("fits-0", list(prompt), SamplingParams(max_tokens=limit)))
    assert s.requests["fits-0"].max_tokens == limit
    if limit < min(default, max_model_len - prompt_len):
        with pytest.raises(RequestRejected):
            Scheduler(cfg).add_request(Request("over-1", list(prompt), SamplingParams(max_tokens=limit + 1)))


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    """Under "priority", with room for one request at a time, requests run in (priority, arrival) order whatever
    order they came in; every output is still the reference output."""
    s = Scheduler(SchedulerConfig(num_blocks=200, block_size=8, max_model_len=512, max_num_seqs=1,
                                  scheduling_policy="priority"))
    reqs = make_requests(6, seed=11, max_tokens=(3, 6))
    for r, p in zip(reqs, (2, 0, 1, 0, 2, -1), strict=True):
        r.priority = p
        s.add_request(r)
    started: list[str] = []

    def check(plan: StepPlan) -> None:
        started.extend(r.request_id for r in plan.requests if r.request_id not in started)

    drive(s, FakePagedModel(200, 8), on_plan=check)
    want = [r.request_id for r in sorted(reqs, key=lambda r: (r.priority, r.arrival_seq))]
    assert started == want
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens, salt_of(r))
    assert_all_blocks_free(s)


def test_priority_policy_preempts_the_lowest_priority_first() -> None:
    """Blocks run out: the victim is the running request last in (priority, arrival) order, even when it came
    first; under fcfs it would be the newest."""
    bs = 8
    for policy, victim in (("priority", "low-0"), ("fcfs", "high-1")):
        s = Scheduler(SchedulerConfig(num_blocks=8, block_size=bs, max_model_len=256, prefill_chunk_size=8,
                                      scheduling_policy=policy))
        low = Request("low-0", list(range(1, 17)), SamplingParams(max_tokens=40, ignore_eos=True))
        high = Request("high-1", list(range(3, 19)), SamplingParams(max_tokens=40, ignore_eos=True))
        if policy == "priority":
            low.priority, high.priority = 5, 0
        s.add_request(low)
        s.add_request(high)
        plans: list[StepPlan] = []
        drive(s, FakePagedModel(8, bs), on_plan=plans.append)
        preempted = [rid for plan in plans for rid in plan.preempted_ids]
        assert preempted and preempted[0] == victim, (policy, preempted)
        for r in (low, high):
            assert r.output_token_ids == reference_output(r.prompt_token_ids, 40, salt_of(r))


def test_fcfs_refuses_a_priority() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=10, block_size=8, max_model_len=64))
    req = Request("p-0", [1, 2, 3], SamplingParams(max_tokens=2))
    req.priority = 1
    with pytest.raises(RequestRejected, match="--scheduling-policy priority"):
        s.add_request(req)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(num_blocks=10, block_size=8, max_model_len=64, scheduling_policy="lifo")
