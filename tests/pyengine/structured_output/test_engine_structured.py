"""Structured output through the real engine on the SmolLM2 GGUF: sampled JSON at temperature 1.0 always parses
and validates (``jsonschema``), and greedy constrained outputs are the same whether steps alternate with their
results, run one step ahead (placeholders, as the serving actors do), or are preempted and recomputed."""

from __future__ import annotations

import json
from collections import deque

import jsonschema
import pytest

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.engine_core import EngineCore
from candle_vllm.pyengine.kv_cache import kv_bytes_per_token
from candle_vllm.pyengine.sampling.params import StructuredOutputParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue", "yellow"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
ASK = [
    "Describe a fictional person as JSON with a name, age, favourite color and some tags.",
    "Invent a character for a story. Answer in JSON.",
    "Give me a JSON record of a musician.",
    "Create a JSON profile of a chef.",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=128)


def chat_prompt(llm: LLM, text: str) -> dict:
    tok = llm.get_tokenizer()
    return {"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                                           add_special_tokens=False)}


@pytest.mark.slow  # 27-90 s on two shared cores
def test_hundred_sampled_outputs_parse_and_validate(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, n=25, seed=11, max_tokens=96,
                            structured_output=StructuredOutputParams(json_schema=PERSON))
    outputs = llm.generate([chat_prompt(llm, a) for a in ASK], params)
    choices = [c for out in outputs for c in out.outputs]
    assert len(choices) == 100
    for c in choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({c.text for c in choices}) > 50, "temperature 1.0 should give varied outputs"


def run_one_step_ahead(core: EngineCore, requests: list[tuple[str, dict, SamplingParams]]
                       ) -> tuple[dict[str, list[int]], int]:
    """Drive the core as the scheduler actor does: step N+1 is planned and run before N's result is applied.
    Returns the outputs by request id and how many preemptions the plans reported."""
    for rid, prompt, params in requests:
        core.add_request(rid, prompt["prompt_token_ids"], params)
    done: dict[str, list[int]] = {}
    preempted = 0
    in_flight: deque = deque()
    while core.has_unfinished():
        while len(in_flight) < 2 and core.scheduler.has_unfinished_requests():
            plan = core.schedule()
            if plan.is_empty:
                break
            preempted += len(plan.preempted_ids)
            in_flight.append((plan, core.runner.execute(plan)))
        plan, result = in_flight.popleft()
        outputs, hits = core.process(core.apply(plan, result))
        core.finish_stop(hits)
        done.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
    return done, preempted


def test_greedy_outputs_survive_pipelining_and_preemption(llm: LLM) -> None:
    constrained = SamplingParams(temperature=0, max_tokens=80, structured_output=StructuredOutputParams(
        json_schema=PERSON))
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [chat_prompt(llm, a) for a in ASK * 2]
    params = [constrained if i % 2 == 0 else plain for i in range(len(prompts))]
    want = [o.outputs[0] for o in llm.generate(prompts, params)]
    tok = llm.get_tokenizer()
    for c, p in zip(want, params, strict=True):
        if p is constrained:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), PERSON)
            assert c.token_ids[-1] in tok.stop_token_ids
    requests = [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]

    ahead, _ = run_one_step_ahead(llm.engine, requests)
    assert [ahead[f"r{i}"] for i in range(len(prompts))] == [c.token_ids for c in want]

    longest = max(len(p["prompt_token_ids"]) for p in prompts) + 80
    cfg = llm.engine.model_config
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, llm.engine.info.dtype)
    small = LLM(max_num_seqs=64, block_size=16, mem=-(-int(3.5 * longest * per_token) // 2**20))
    squeezed, preemptions = run_one_step_ahead(small.engine, requests)
    assert preemptions > 0, "the cache must be small enough to preempt"
    assert [squeezed[f"r{i}"] for i in range(len(prompts))] == [c.token_ids for c in want]
    assert small.engine.scheduler.kv.usage == 0.0


def test_aborted_and_finished_requests_release_their_matchers(llm: LLM) -> None:
    core = llm.engine
    grammars = core.runner.grammars
    assert grammars is not None
    prompt = chat_prompt(llm, ASK[0])["prompt_token_ids"]
    so = StructuredOutputParams(json_schema=PERSON)
    core.add_request("keep", prompt, SamplingParams(temperature=1.0, max_tokens=96, structured_output=so))
    core.add_request("drop", prompt, SamplingParams(temperature=1.0, n=3, max_tokens=96, structured_output=so))
    for _ in range(3):
        core.step()
    assert len(grammars) == 4
    core.abort("drop")
    core.step()
    assert len(grammars) == 1
    while core.has_unfinished():
        core.step()
    llm.generate(["one more"], SamplingParams(max_tokens=2))  # the next plan lists the finished request
    assert len(grammars) == 0
