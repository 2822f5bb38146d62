"""End to end: the real ``lm-eval`` harness (``local-completions``) against our server running the real engine on
the CPU, offline. lm-eval depends on the exact shape of ``echo`` + ``logprobs`` (it slices
``token_logprobs[ctxlen:-1]`` and calls a continuation greedy when its logprob equals ``max(top_logprobs)``), on
list prompts, on stop strings and on the server's tokenizer endpoints (``tokenizer_backend=auto`` picks
``/tokenizer_info`` + ``/tokenize`` instead of the hub), and a drift in any of them skews benchmark scores
silently instead of failing. So its loglikelihoods are checked against llama.cpp on the same GGUF file, and its
generations against the server's own greedy completions through the ``openai`` client."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.api.conftest import ServerThread

lm_eval = pytest.importorskip("lm_eval")
lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
lm_eval_openai = pytest.importorskip("lm_eval.models.openai_completions")

# Short, varied items: a context ending in a space (lm-eval moves it into the continuation), multi-token and
# non-ASCII continuations, and easy ones whose right answer is the model's greedy choice.
MC_ITEMS: list[dict[str, Any]] = [
    {"question": "1, 2, 3, 4,", "choices": ["5", "7", "banana"], "label": 0},
    {"question": "Monday, Tuesday,", "choices": ["Wednesday", "Friday", "purple"], "label": 0},
    {"question": "The capital of France is ", "choices": ["Paris", "Berlin", "a small dog"], "label": 0},
    {"question": "A cup of coffee in a French café costs", "choices": ["two euros", "café au lait", "zero"],
     "label": 0},
    {"question": "Q: What colour is the sky?\nA:", "choices": ["Blue", "Green", "Loud"], "label": 0},
    {"question": "a b c d e", "choices": ["f", "z", "ü ö ä"], "label": 0},
]
# Greedy continuations that hit each stop string, one that stops at once, and one that runs to max_gen_toks.
GEN_ITEMS: list[dict[str, str]] = [
    {"prompt": "1, 2, 3, 4,", "target": "5"},
    {"prompt": "Once upon a time", "target": "there"},
    {"prompt": "The capital of France is", "target": "Paris"},
    {"prompt": "Q: What colour is the sky?\nA:", "target": "Blue"},
    {"prompt": "def add(a, b):\n", "target": "return"},
    {"prompt": "My name is John and I", "target": "am"},
]
UNTIL = [".", "\n", ","]
MAX_GEN_TOKS = 10
LOGPROB_ABS_TOL = 5e-3  # per continuation; measured <= 2e-5 per token with F32 weights and KV cache on both sides
GREEDY_MARGIN = 0.01  # compare is_greedy only where the verdict holds by a clear logprob gap


@pytest.fixture(scope="module")
def server(f32_server: ServerThread) -> ServerThread:
    return f32_server


@pytest.fixture(scope="module")
def model(server: ServerThread) -> str:
    return server.openai().models.list().data[0].id


@pytest.fixture(scope="module")
def oracle(f32_oracle: Any) -> Any:
    return f32_oracle


@pytest.fixture
def payloads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every (tokenizer backend, request body) lm-eval's ``local-completions`` builds during the test."""
    sent: list[tuple[str, dict[str, Any]]] = []
    api = lm_eval_openai.LocalCompletionsAPI
    original = api._create_payload

    def spy(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        payload = original(self, *args, **kwargs)
        sent.append((self.tokenizer_backend, copy.deepcopy(payload)))
        return payload

    monkeypatch.setattr(api, "_create_payload", spy)
    return sent


def write_task(root: Path, name: str, items: list[dict[str, Any]], config: str) -> None:
    """A custom task YAML over a local JSONL file (no hub), with the datasets cache kept under ``root``."""
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
    (root / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files: {{test: {json.dumps(str(data))}}}\n"
        f"  cache_dir: {json.dumps(str(root / 'hf-cache'))}\n"
        "test_split: test\n" + config, encoding="utf-8")


def evaluate(server: ServerThread, model: str, root: Path, task: str, batch_size: int,
             tokenized_requests: bool = False) -> list[dict[str, Any]]:
    """Run ``lm_eval.simple_evaluate`` on one task of ``root``; its logged samples in dataset order."""
    model_args = {"model": model, "base_url": f"{server.http_base}/v1/completions", "num_concurrent": 2,
                  "tokenized_requests": tokenized_requests, "tokenizer_backend": "auto", "max_retries": 1}
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=[task], batch_size=batch_size, log_samples=True,
        task_manager=lm_eval_tasks.TaskManager(include_path=str(root), include_defaults=False), bootstrap_iters=0)
    assert out is not None
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def llama_score(llm: Any, tokens: list[int], ctxlen: int) -> tuple[float, bool, float]:
    """llama.cpp's log P(tokens[ctxlen:] | tokens[:ctxlen]), whether every such token is the argmax, and the
    logprob gap by which that verdict holds (smallest top-1 lead if greedy, else the largest miss)."""
    llm.reset()
    llm.eval(tokens)
    logits = np.asarray(llm.scores[: len(tokens)], dtype=np.float64)
    logprobs = logits - logits.max(axis=-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(axis=-1, keepdims=True))
    total, leads, misses = 0.0, [], []
    for i in range(ctxlen, len(tokens)):
        row = logprobs[i - 1]
        second, first = np.sort(row)[-2:]
        total += row[tokens[i]]
        if row[tokens[i]] == first:
            leads.append(first - second)
        else:
            misses.append(first - row[tokens[i]])
    return total, not misses, float(max(misses) if misses else min(leads))


@pytest.mark.parametrize("tokenized_requests", [False, True], ids=["text", "token-ids"])
def test_loglikelihood_matches_llama_cpp(server: ServerThread, model: str, oracle: Any, tmp_path: Path,
                                         payloads: list[tuple[str, dict[str, Any]]],
                                         tokenized_requests: bool) -> None:
    write_task(tmp_path, "smol_mc", MC_ITEMS,
               "output_type: multiple_choice\n"
               "doc_to_text: '{{question}}'\n"
               "doc_to_choice: '{{choices}}'\n"
               "doc_to_target: '{{label}}'\n"
               "metric_list:\n  - metric: acc\n")
    samples = evaluate(server, model, tmp_path, "smol_mc", batch_size=1, tokenized_requests=tokenized_requests)
    assert [s["doc"] for s in samples] == MC_ITEMS
    n_requests = sum(len(item["choices"]) for item in MC_ITEMS)
    assert len(payloads) == n_requests
    for backend, body in payloads:
        assert backend == "remote"
        prompt = body["prompt"]
        if tokenized_requests:  # a batch of one list of token ids
            assert len(prompt) == 1 and all(isinstance(t, int) for t in prompt[0])
        else:
            assert isinstance(prompt, str)
        assert (body["max_tokens"], body["logprobs"], body["echo"]) == (1, 1, True)

    checked = {True: 0, False: 0}
    with server.http() as http:
        for sample in samples:
            for (context, continuation), [(ll, is_greedy)] in zip(sample["arguments"], sample["resps"],
                                                                  strict=True):
                # lm-eval's _encode_pair: trailing spaces of the context go to the continuation
                spaces = len(context) - len(context.rstrip())
                if spaces:
                    context, continuation = context[:-spaces], context[-spaces:] + continuation
                whole = oracle.tokenize((context + continuation).encode(), add_bos=False, special=False)
                ctxlen = len(oracle.tokenize(context.encode(), add_bos=False, special=False))
                served = http.post("/tokenize", json={"prompt": context + continuation, "add_special_tokens": False})
                label = f"{context!r} + {continuation!r}"
                assert served.json()["tokens"] == whole, label
                want, greedy, margin = llama_score(oracle, whole, ctxlen)
                assert math.isfinite(ll) and ll == pytest.approx(want, abs=LOGPROB_ABS_TOL), label
                if margin > GREEDY_MARGIN:
                    assert is_greedy == greedy, (label, margin)
                    checked[greedy] += 1
    assert checked[True] >= 2 and checked[False] >= 2, checked  # both verdicts exercised


def test_generate_until_matches_openai_client(server: ServerThread, model: str, tmp_path: Path,
                                              payloads: list[tuple[str, dict[str, Any]]]) -> None:
    gen_kwargs = json.dumps({"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS, "temperature": 0, "do_sample": False})
    write_task(tmp_path, "smol_gen", GEN_ITEMS,
               "output_type: generate_until\n"
               "doc_to_text: '{{prompt}}'\n"
               "doc_to_target: '{{target}}'\n"
               f"generation_kwargs: {gen_kwargs}\n"
               "metric_list:\n  - metric: exact_match\n")
    samples = evaluate(server, model, tmp_path, "smol_gen", batch_size=2)
    assert [s["doc"] for s in samples] == GEN_ITEMS
    sent: dict[str, dict[str, Any]] = {}
    for _, body in payloads:
        assert isinstance(body["prompt"], list) and len(body["prompt"]) == 2  # batch_size=2: a list prompt
        assert (body["temperature"], body["max_tokens"]) == (0, MAX_GEN_TOKS)
        sent.update(dict.fromkeys(body["prompt"], body))
    assert sorted(sent) == sorted(item["prompt"] for item in GEN_ITEMS)

    client = server.openai()
    finishes = []
    for sample, item in zip(samples, GEN_ITEMS, strict=True):
        [[got]] = sample["resps"]
        body = sent[item["prompt"]]
        want = client.completions.create(model=model, prompt=item["prompt"], max_tokens=body["max_tokens"],
                                         temperature=0, stop=body["stop"]).choices[0]
        assert got == want.text, item
        free = client.completions.create(model=model, prompt=item["prompt"], max_tokens=MAX_GEN_TOKS,
                                         temperature=0).choices[0].text
        if want.finish_reason == "stop":
            # cut right before the first stop string of the unconstrained greedy text
            assert got == free[: min(free.index(s) for s in UNTIL if s in free)], (got, free)
        else:
            assert got == free and not any(s in free for s in UNTIL), (got, free)
        finishes.append(want.finish_reason)
    assert finishes.count("stop") >= 3 and "length" in finishes, finishes
