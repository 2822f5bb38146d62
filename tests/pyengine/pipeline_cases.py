"""Shared pieces of the step-pipeline tests: a tiny random Llama (dummy weights, word-level tokenizer), the
strictly serial engine drive (schedule, execute, apply, process, one step at a time: the behaviour before the
pipeline) and a summary of outputs to compare token for token."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.engine_core import EngineCore
from candle_vllm.pyengine.outputs import RequestOutput

VOCAB = 512
# head_dim 64 (the CUDA decode kernel takes 64/128/256), GQA group 2, so the same model serves the GPU test.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
}

Summary = tuple[tuple[tuple[int, ...], str, str | None, str | int | None], ...]


def tiny_model_dir(path: Path) -> Path:
    """A config and a word-level tokenizer ("t0 t1 ...") whose ids are the model's whole vocabulary."""
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    return path


def tiny_llm(path: Path, **engine_args: Any) -> LLM:
    """The tiny model on the CPU unless ``cpu=False`` is passed (then on the GPU where there is one)."""
    args: dict[str, Any] = {"load_format": "dummy", "dtype": "f32", "mem": 16, "max_num_seqs": 32, "seed": 0,
                            "cpu": True}
    args.update(engine_args)
    return LLM(model=str(path), **args)


def random_prompts(rng: random.Random, count: int, low: int = 2, high: int = 40) -> list[list[int]]:
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def summary(out: RequestOutput) -> Summary:
    """Every choice's tokens, text, finish reason and stop reason."""
    return tuple((tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in out.outputs)


def serial_generate(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> list[Summary]:
    """The engine driven strictly one step at a time: each plan is made after the previous step's tokens were
    applied, and run with ``runner.execute`` (launch and read back at once), so no placeholder ever exists."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"serial-{i}", prompt, p)
    done: dict[str, Summary] = {}
    while core.has_unfinished():
        plan = core.schedule()
        assert not (plan.input_ids < 0).any(), "a serial drive never plans placeholders"
        if plan.is_empty:
            core.runner.execute(plan)
            continue
        outputs, hits = core.process(core.apply(plan, core.runner.execute(plan)))
        core.finish_stop(hits)
        done.update({o.request_id: summary(o) for o in outputs if o.finished})
    return [done[f"serial-{i}"] for i in range(len(prompts))]


def pipelined_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Summary]:
    """The offline API (``EngineCore.step``: up to two steps in flight)."""
    return [summary(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def fail_forward_on_call(llm: LLM, monkeypatch: Any, call: int) -> Callable[[], int]:
    """Make the model's ``call``-th forward (from now) raise an injected device fault; returns a counter of the
    forwards made so far."""
    model = llm.engine.runner.model
    forward = model.forward
    calls = 0

    def failing_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == call:
            raise RuntimeError("injected device fault")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", failing_forward)
    return lambda: calls
