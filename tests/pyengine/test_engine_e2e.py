"""The engine end to end on the real SmolLM2 GGUF (CPU): batch invariance, preemption, prefix cache, aborts
and sampling through the offline API and EngineCore."""

from __future__ import annotations

import random

import pytest
import torch
from pipeline_cases import fail_forward_on_call

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.engine_core import EngineCore
from candle_vllm.pyengine.kv_cache import kv_bytes_per_token
from candle_vllm.pyengine.outputs import RequestOutput

PROMPTS = [
    f"{topic} Here is a short note number {i}:"
    for i, topic in enumerate(
        ["The ocean is deep.", "Paris is a city.", "def add(a, b):", "Once upon a time,", "Photosynthesis",
         "The year 1969", "Bananas are yellow.", "import numpy as np", "Dear friend,", "Mount Everest",
         "Quantum computing", "In the kitchen,", "SELECT * FROM", "The violin", "Rain fell", "A haiku:"] * 2
    )
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=64)


def _texts(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_batch_invariance(llm: LLM) -> None:
    together = _texts(llm.generate(PROMPTS, GREEDY))
    one_by_one = [_texts(llm.generate([p], GREEDY))[0] for p in PROMPTS]
    assert together == one_by_one

    # Requests arriving at random steps while others run.
    engine: EngineCore = llm.engine
    rng = random.Random(0)
    pending = list(enumerate(PROMPTS))
    rng.shuffle(pending)
    results: dict[str, list[int]] = {}
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, p = pending.pop()
                engine.add_request(f"arrive-{i}", llm.get_tokenizer().encode(p), GREEDY)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert [results[f"arrive-{i}"] for i in range(len(PROMPTS))] == one_by_one


def test_preemption_finishes_everything_with_identical_outputs(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [p * 4 for p in PROMPTS]
    want = _texts(llm.generate(prompts, params))
    longest = max(len(llm.get_tokenizer().encode(p)) for p in prompts) + 40
    cfg = llm.engine.model_config
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, llm.engine.info.dtype)
    small = LLM(max_num_seqs=64, block_size=16, mem=-(-int(4.5 * longest * per_token) // 2**20))
    capacity = small.engine.info.kv_capacity_tokens
    assert longest <= capacity < 6 * longest, "the cache must hold a few sequences only, forcing preemption"
    got = _texts(small.generate(prompts, params))
    assert got == want
    assert small.engine.scheduler.kv.usage == 0.0


def _prompt_lps(out: object) -> list[dict[int, float] | None]:
    entries = out.prompt_logprobs  # type: ignore[attr-defined]
    assert entries is not None
    return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries]


def _assert_close(got: list[dict[int, float] | None], want: list[dict[int, float] | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None and w is not None:
            assert g.keys() == w.keys() and all(g[t] == pytest.approx(w[t], abs=1e-4) for t in w)


def test_prompt_logprobs_survive_prefix_hits_and_preemption(llm: LLM) -> None:
    """One entry per prompt token, equal to a plain run's, when the prompt is in the prefix cache (such requests
    skip it: a hit computes no logits for the cached rows) and when the request is preempted and recomputes
    its prompt (the recomputed chunks must not be added again)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    prompts = [p * 4 for p in PROMPTS[:6]]
    tok = llm.get_tokenizer()
    want = llm.generate(prompts, params)
    for prompt, out in zip(prompts, want, strict=True):
        assert len(_prompt_lps(out)) == len(tok.encode(prompt))
    again = llm.generate(prompts, params)  # every prompt is in the prefix cache now
    for first, second in zip(want, again, strict=True):
        assert second.num_cached_tokens == 0
        _assert_close(_prompt_lps(second), _prompt_lps(first))

    longest = max(len(tok.encode(p)) for p in prompts) + 12
    cfg = llm.engine.model_config
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, llm.engine.info.dtype)
    small = LLM(max_num_seqs=64, block_size=16, mem=-(-int(2.5 * longest * per_token) // 2**20))
    preempt = small.engine.scheduler._preempt
    preemptions = 0

    def counting(*args: object) -> None:
        nonlocal preemptions
        preemptions += 1
        preempt(*args)  # type: ignore[arg-type]

    small.engine.scheduler._preempt = counting  # type: ignore[method-assign, assignment]
    got = small.generate(prompts, params)
    assert preemptions > 0, "the cache must be small enough to preempt"
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        _assert_close(_prompt_lps(g), _prompt_lps(w))


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    words = " ".join(f"w{i}" for i in range(2000))
    prefix = tok.encode(words)[:1000]
    a = {"prompt_token_ids": prefix + tok.encode(" first question")}
    b = {"prompt_token_ids": prefix + tok.encode(" second one")}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([a], params)
    hit = llm.generate([b], params)[0]
    assert hit.num_cached_tokens >= 992
    fresh = LLM(disable_prefix_cache=True).generate([b], params)[0]
    assert fresh.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_random_aborts_free_every_block() -> None:
    llm = LLM(max_num_seqs=32, prefill_chunk_size=16, block_size=16)
    engine = llm.engine
    tok = llm.get_tokenizer()
    rng = random.Random(1)
    live: list[str] = []
    aborted = 0
    next_id = 0
    while aborted < 1000:
        while len(live) < 24:
            prompt = tok.encode(" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(5, 60))))
            rid = f"r{next_id}"
            next_id += 1
            engine.add_request(rid, prompt, SamplingParams(temperature=0.7, max_tokens=rng.randint(2, 40)))
            live.append(rid)
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        for _ in range(rng.randint(0, 6)):
            if live:
                rid = live.pop(rng.randrange(len(live)))
                final = engine.abort(rid)
                assert final is not None and final.finished
                aborted += 1
    for rid in live:
        engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.scheduler.kv.usage == 0.0
    assert engine.scheduler.kv.num_free_blocks == engine.info.num_blocks


def test_out_of_vocabulary_prompt_ids_are_refused_and_leave_nothing_behind(llm: LLM) -> None:
    """An id past the vocabulary (or negative) would fail the whole step it runs in, and before this check left
    the engine stuck: it is refused up front, and the prompts queued before it in the same call are dropped."""
    engine: EngineCore = llm.engine
    vocab = min(engine.model_config.vocab_size, llm.get_tokenizer().vocab_size)
    want = _texts(llm.generate(PROMPTS[:2], GREEDY))
    for bad in (vocab, vocab + 7, -3):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([PROMPTS[0], {"prompt_token_ids": [1, 2, bad]}], GREEDY)
        assert not engine.has_unfinished()
        assert engine.scheduler.kv.num_free_blocks == engine.info.num_blocks
    assert _texts(llm.generate(PROMPTS[:2], GREEDY)) == want


def test_a_failed_step_leaves_the_offline_engine_usable(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises fails its generate call; the engine then has nothing left over, and the next call
    runs as if nothing had happened (before, every later call failed on the failed step's placeholders)."""
    engine: EngineCore = llm.engine
    want = _texts(llm.generate(PROMPTS[:3], GREEDY))
    fail_forward_on_call(llm, monkeypatch, 3)
    with pytest.raises(RuntimeError, match="injected device fault"):
        llm.generate(PROMPTS[:3], GREEDY)
    assert not engine.has_unfinished()
    assert engine.scheduler.kv.num_free_blocks == engine.info.num_blocks
    assert _texts(llm.generate(PROMPTS[:3], GREEDY)) == want


def test_min_tokens_holds_back_stop_strings(llm: LLM) -> None:
    """vLLM: the text of the first min_tokens tokens never matches a stop string, so generation goes on."""
    prompt = "The capital of France is"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop=["."]))[0].outputs[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 8, "the prompt must stop early on its own"
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=8, stop=["."]))[0]
    assert len(held.outputs[0].token_ids) >= 8


def test_detokenize_false_gives_ids_only(llm: LLM) -> None:
    """vLLM's detokenize=False: the same token ids, no text, logprobs without decoded tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    ids_only = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                              detokenize=False)
    want, got = (llm.generate([PROMPTS[0]], p)[0] for p in (greedy, ids_only))
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and want.outputs[0].text
    assert got.outputs[0].text == ""
    entries = [*(got.outputs[0].logprobs or []), *(e for e in got.prompt_logprobs or [] if e is not None)]
    assert entries and all(lp.decoded_token is None for e in entries for lp in e.values())


def test_params_changed_after_construction_are_honoured() -> None:
    """Server defaults fill only the fields a caller left unset, including those it set after construction."""
    llm = LLM(temperature=0.8)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    params.max_tokens = 3
    assert len(llm.generate(["The ocean is"], params)[0].outputs[0].token_ids) == 3
    later = SamplingParams(max_tokens=8, seed=0, ignore_eos=True)
    later.temperature = 0.0
    greedy = llm.generate(["The ocean is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert _texts(llm.generate(["The ocean is"], later)) == _texts(greedy)


def test_seeded_sampling_is_reproducible_inside_different_batches(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    mixed = llm.generate([*PROMPTS[3:9], PROMPTS[0]], [others] * 6 + [seeded])[-1].outputs[0].token_ids
    assert alone == mixed
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], other_seed)[0].outputs[0].token_ids != alone


def test_top_k_1_equals_greedy(llm: LLM) -> None:
    top1 = SamplingParams(temperature=0.9, top_k=1, max_tokens=12, ignore_eos=True)
    assert _texts(llm.generate(PROMPTS[:6], top1)) == _texts(llm.generate(PROMPTS[:6], GREEDY))


def test_logprobs_equal_log_softmax_of_the_models_logits(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPTS[1])
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3))[0]
    ids = prompt + out.outputs[0].token_ids
    # Oracle: one forward pass of the whole sequence through a fresh paged cache. Attention, norms and the
    # quantized matmuls compute each token alone in a fixed order, so this equals the engine's chunked steps.
    from candle_vllm.pyengine.kv_cache import allocate_kv_caches
    from candle_vllm.pyengine.ops.attention import AttentionMetadata

    model = llm.engine.runner.model
    cfg = llm.engine.model_config
    bs = 32
    n_blocks = -(-len(ids) // bs)
    fresh = allocate_kv_caches(cfg.num_layers, n_blocks, bs, cfg.num_kv_heads, cfg.head_dim, llm.engine.info.dtype,
                               torch.device("cpu"))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], block_tables=[list(range(n_blocks))], block_size=bs)
    caches, model.kv_caches = model.kv_caches, fresh
    try:
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta)
            ref = torch.log_softmax(model.compute_logits(hidden), dim=-1)
    finally:
        model.kv_caches = caches
    n = len(prompt)
    assert out.outputs[0].logprobs is not None
    for i, entry in enumerate(out.outputs[0].logprobs):
        tok_id = out.outputs[0].token_ids[i]
        assert entry[tok_id].logprob == pytest.approx(ref[n - 1 + i, tok_id].item(), abs=1e-5)
        top = torch.topk(ref[n - 1 + i], 5).indices.tolist()
        assert set(top) <= set(entry)
        assert entry[tok_id].rank == 1  # greedy picks the most likely token
    assert out.prompt_logprobs is not None
    assert out.prompt_logprobs[0] is None
    for j in range(1, n):
        prompt_entry = out.prompt_logprobs[j]
        assert prompt_entry is not None
        assert prompt_entry[prompt[j]].logprob == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-5)


def test_unset_max_tokens_is_cut_to_the_kv_cache() -> None:
    """A request without max_tokens gets the default cut to what the cache holds after its prompt (it never asked
    for more, so it must not be refused for the default), and runs to that many tokens."""
    small = LLM(block_size=16, mem=10)
    capacity = small.engine.info.kv_capacity_tokens
    prompt = "Tell me a story."
    n_prompt = len(small.get_tokenizer().encode(prompt))
    assert small.engine.max_gen_tokens > capacity - n_prompt + 1, "the default must not fit, or nothing is tested"
    out = small.generate([prompt], SamplingParams(temperature=0, ignore_eos=True))[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (capacity - n_prompt + 1, "length")


def _prompt_logprob_moves(want: list[RequestOutput], got: list[RequestOutput]) -> list[float]:
    """How far each prompt token's log-probability moved from ``want`` to ``got`` (same prompts)."""
    diffs: list[float] = []
    for w_out, g_out in zip(want, got, strict=True):
        ids = w_out.prompt_token_ids
        for i, (w, g) in enumerate(zip(_prompt_lps(w_out), _prompt_lps(g_out), strict=True)):
            if w is not None and g is not None:
                diffs.append(abs(w[ids[i]] - g[ids[i]]))
    return diffs


def test_fp8_kv_cache_holds_four_times_the_tokens_and_stays_close() -> None:
    """--kvcache-dtype fp8 on the CPU: an e4m3 cache (1 byte a value against f32's 4) holds four times the
    blocks in the same budget, and the prompt's log-probabilities move (the e4m3 values are what attention
    reads) but stay near the f32 cache's."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    prompts = [p * 3 for p in PROMPTS[:4]]
    f32, fp8 = LLM(mem=16, cpu=True), LLM(mem=16, cpu=True, kvcache_dtype="fp8")
    assert {c.dtype for c in fp8.engine.runner.model.kv_caches} == {torch.float8_e4m3fn}
    assert fp8.engine.info.kv_cache_dtype == torch.float8_e4m3fn and f32.engine.info.kv_cache_dtype == torch.float32
    blocks = f32.engine.info.num_blocks
    assert 4 * blocks <= fp8.engine.info.num_blocks < 4 * (blocks + 1)  # both floor(budget / block bytes)
    diffs = _prompt_logprob_moves(f32.generate(prompts, params), fp8.generate(prompts, params))
    mean = sum(diffs) / len(diffs)
    # e4m3 keeps 3 mantissa bits (a value moves up to 1/16); on this 135M model that measured a mean move of
    # 0.075 nats per prompt token, the largest 1.1
    assert 0 < mean < 0.15 and max(diffs) < 3.0, (mean, max(diffs))


# SmolLM2 has 3 kv heads of 64 channels: an f32 row pair is 512 bytes, a TurboQuant row 100 / 72 / 64. Measured
# mean moves of the prompt log-probabilities (nats per token): turbo8 0.16, turbo4 0.21, turbo3 0.55 (largest
# 1.4 / 1.5 / 2.9); a 135M model with 64-channel heads is more sensitive than the 8B models TurboQuant targets.
@pytest.mark.parametrize(("mode", "row_bytes", "mean_bound"), [("turbo8", 100, 0.3), ("turbo4", 72, 0.35),
                                                              ("turbo3", 64, 0.9)])
def test_turbo_kv_caches_hold_more_tokens_and_stay_close(mode: str, row_bytes: int, mean_bound: float) -> None:
    """--kvcache-dtype turbo8/4/3 on the CPU: blocks in proportion to the row size in the same budget, the mode
    in the engine's summary, prompt log-probabilities near the f32 cache's, and greedy decoding running on."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    prompts = [p * 3 for p in PROMPTS[:4]]
    f32, tq = LLM(mem=16, cpu=True), LLM(mem=16, cpu=True, kvcache_dtype=mode)
    assert {(c.dtype, c.shape[-1]) for c in tq.engine.runner.model.kv_caches} == {(torch.uint8, row_bytes)}
    assert tq.engine.info.kv_cache_label == mode and f32.engine.info.kv_cache_label == "float32"
    block_bytes = tq.engine.info.block_size * 30 * 3 * row_bytes  # 30 layers x 3 kv heads of rows
    assert tq.engine.info.num_blocks == 16 * 1024 * 1024 // block_bytes
    diffs = _prompt_logprob_moves(f32.generate(prompts, params), tq.generate(prompts, params))
    mean = sum(diffs) / len(diffs)
    assert 0 < mean < mean_bound and max(diffs) < 5.0, (mean, max(diffs))
    out = tq.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
