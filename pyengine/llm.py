"""The offline API with vLLM's names, so users' code ports unchanged:
``LLM(model=...).generate(prompts, SamplingParams(...))``, ``.chat(messages, ...)``, ``.embed`` and
``.beam_search(prompts, BeamSearchParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, cast

from tqdm import tqdm

from candle_vllm.pyengine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    first_token_logprobs,
)
from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.engine_core import EngineCore
from candle_vllm.pyengine.loader.pooling import truncated
from candle_vllm.pyengine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from candle_vllm.pyengine.pooling_params import PoolingParams, embedding_keep
from candle_vllm.pyengine.sampling import SamplingDefaults, SamplingParams
from candle_vllm.pyengine.tokenizer import Tokenizer


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt`` (``from vllm import TextPrompt``): a prompt as text, tokenized by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt``: a prompt as token ids, sent to the model as given."""

    prompt_token_ids: list[int]


PromptType = str | Mapping[str, Any]  # text, or a TextPrompt / TokensPrompt (or a dict of their keys)
Message = dict[str, Any]

# vLLM's dtype names (``LLM(dtype="half")``) -> ours; "auto" is our default choice per device.
_VLLM_DTYPES: dict[str, str | None] = {
    "auto": None, "bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "f32", "float": "f32",
}


def _engine_args_from_vllm_names(args: dict[str, Any]) -> dict[str, Any]:
    """Code written for vLLM passes vLLM's names for engine args; those that mean exactly what one of ours means
    are translated, so such ``LLM(...)`` calls run unchanged. Names that only look alike (``gpu_memory_utilization``
    sizes weights, activations and cache together; ``--kv-fraction`` sizes the cache from what is free after
    loading) stay unknown and are refused by ``EngineArgs``."""
    args = dict(args)
    if isinstance(args.get("dtype"), str) and args["dtype"] in _VLLM_DTYPES:
        args["dtype"] = _VLLM_DTYPES[args["dtype"]]
    renames: dict[str, tuple[str, Callable[[Any], Any]]] = {
        "enforce_eager": ("disable_cuda_graph", bool),
        "enable_prefix_caching": ("disable_prefix_cache", lambda on: not on),
        # Tensor parallelism over N devices is --d 0..N-1, which EngineArgs refuses while it is not built.
        "tensor_parallel_size": ("device_ids", lambda n: None if n == 1 else list(range(n))),
    }
    for name, (ours, convert) in renames.items():
        if name in args:
            if ours in args:
                raise TypeError(f"pass {name} (vLLM's name) or {ours}, not both")
            args[ours] = convert(args.pop(name))
    # vLLM's permission to run a model repository's Python code; this engine never runs any, so it changes nothing.
    args.pop("trust_remote_code", None)
    return args


class LLM:
    """Runs a model over batches of prompts with continuous batching; engine args are named like the CLI flags,
    and vLLM's names for the same settings are accepted too (``dtype="bfloat16"``, ``enforce_eager``...)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """``seed`` defaults to 0 as in vLLM V1 (0.9 and later), so requests without a seed of their own sample the
        same tokens run after run of the same script; pass ``seed=None`` for a fresh random stream each run."""
        engine_args = _engine_args_from_vllm_names(engine_args)
        engine_args.setdefault("seed", 0)
        self.engine = EngineCore(EngineArgs.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the parameters a call without any samples with (the model's generation_config.json and the
        engine's sampling args over vLLM's defaults), for code that starts from them and changes a few fields."""
        defaults = dataclasses.asdict(self.engine.sampling_defaults)
        return SamplingParams(**{name: value for name, value in defaults.items() if value is not None})

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": ...}``);
        ``sampling_params`` is one for all prompts or one per prompt; ``priority`` one per prompt (vLLM's, lower
        first, with ``scheduling_policy="priority"``). Outputs keep the prompts' order."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        requests = []
        for prompt, p in zip(prompts, params, strict=True):
            text, token_ids = self._tokenize(prompt)
            requests.append((text, token_ids, p))
        return self._run(requests, use_tqdm, priority)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: each prompt's embedding, the final-normed hidden state of its last token,
        L2-normalised (last-token pooling, what decoder embedding models such as Qwen3-Embedding, gte-Qwen2 and
        e5-mistral are trained for). Prompts take the forms ``generate`` takes; ``pooling_params`` is one for all
        prompts or one per prompt (``dimensions``: Matryoshka truncation); ``truncate_prompt_tokens`` applies to
        the prompts whose params set none. Outputs keep the prompts' order."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        pooling = [pooling_params or PoolingParams()] * len(prompts) \
            if pooling_params is None or isinstance(pooling_params, PoolingParams) else list(pooling_params)
        if len(pooling) != len(prompts):
            raise ValueError(f"{len(pooling)} pooling params for {len(prompts)} prompts")
        for p in pooling:
            if p.dimensions is not None:
                self.engine.matryoshka.check(self.engine.info.model_name, p.dimensions)
        def params(p: PoolingParams) -> SamplingParams:
            keep = p.truncate_prompt_tokens if p.truncate_prompt_tokens is not None else truncate_prompt_tokens
            return SamplingParams(max_tokens=1, temperature=0, embed=True,
                                  truncate_prompt_tokens=embedding_keep(keep, self.engine.max_model_len))

        outs = self._run([(*self._tokenize(prompt), params(p)) for prompt, p in zip(prompts, pooling, strict=True)],
                         use_tqdm)
        vectors = [out.embedding for out in outs]
        if any(v is None for v in vectors):
            raise RuntimeError("an embedding request finished without its embedding")
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(truncated(cast("list[float]", v), p.dimensions)),
                                       out.prompt_token_ids)
                for out, v, p in zip(outs, vectors, pooling, strict=True)]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``params.beam_width`` continuations of each prompt, best first. As in
        vLLM, each sequence's ``tokens`` hold the prompt too (and a final stop token), and its ``text`` is all of
        them decoded, special tokens included. The prompts' searches go on together: a step runs every live beam
        of every prompt as one batch."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        tok = self.engine.tokenizer
        searches = [BeamSearch(self._tokenize(p)[1], params, tok.stop_token_ids) for p in prompts]
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
            live = [s for s in searches if not s.done]
            if not live:
                break
            outs = iter(self._run([(None, beam, s.step_params) for s in live for beam in s.beam_prompts()], False))
            for s in live:
                s.advance([first_token_logprobs(next(outs)) for _ in s.beams])
        outputs = [s.best() for s in searches]
        for seq in (seq for out in outputs for seq in out.sequences):
            seq.text = tok.decode(seq.tokens, skip_special_tokens=False)
        return outputs

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = False,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate a reply; with
        ``continue_final_message`` (and ``add_generation_prompt=False``, as in vLLM) the model goes on with the
        last message (an assistant reply begun by the caller) instead of starting a new one."""
        conversations = cast(
            "Sequence[Sequence[Message]]", [messages] if messages and isinstance(messages[0], dict) else messages
        )
        params = self._params_per_prompt(sampling_params, len(conversations))
        tok = self.engine.tokenizer
        requests: list[tuple[str | None, list[int], SamplingParams]] = []
        for conv, p in zip(conversations, params, strict=True):
            text = tok.apply_chat_template(list(conv), tools=tools, add_generation_prompt=add_generation_prompt,
                                           chat_template_kwargs=chat_template_kwargs, chat_template=chat_template,
                                           continue_final_message=continue_final_message)
            requests.append((text, tok.encode(text, add_special_tokens=False), p))
        return self._run(requests, use_tqdm)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        """One params per prompt. Without any, the model's generation_config.json fills every field (vLLM's
        ``get_default_sampling_params``); a caller's own params keep vLLM's defaults where they say nothing, as in
        vLLM, which applies generation_config.json only to calls without params (the engine's sampling args,
        ``LLM(temperature=...)``, still fill them: the caller chose those too)."""
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        given = [sampling_params] * count if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(given) != count:
            raise ValueError(f"{len(given)} sampling params for {count} prompts")
        plain = SamplingParams()  # vLLM's defaults, for the fields a generation_config.json may set
        fills = {f.name: getattr(plain, f.name) for f in dataclasses.fields(SamplingDefaults)}
        fills |= self.engine.args.sampling_defaults()
        return [p.with_settings(**{k: v for k, v in fills.items() if k not in p.explicit_fields}) for p in given]

    def _run(self, requests: list[tuple[str | None, list[int], SamplingParams]], use_tqdm: bool,
             priority: Sequence[int] | None = None) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for i, (text, token_ids, params) in enumerate(requests):
                request_id = str(next(self._ids))
                engine.add_request(request_id, token_ids, params, prompt=text,
                                   priority=0 if priority is None else priority[i])
                order[request_id] = len(order)
        except Exception:  # a refused prompt: the ones queued before it must not run in a later call
            for request_id in order:
                engine.abort(request_id)
            raise
        results: list[RequestOutput | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="Generating", disable=not use_tqdm)
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except Exception:  # a failed step: this call's other requests must not run in a later call either
            for request_id, i in order.items():
                if results[i] is None:
                    engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]

