"""The offline API with vLLM's names, so users' code ports unchanged:
``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``.chat(messages, ...)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.engine_core import EngineCore
from candle_vllm.pyengine.outputs import RequestOutput
from candle_vllm.pyengine.sampling import SamplingParams
from candle_vllm.pyengine.tokenizer import Tokenizer

PromptType = str | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """Runs a model over batches of prompts with continuous batching; engine args are named like the CLI flags."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = EngineCore(EngineArgs.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": ...}``);
        ``sampling_params`` is one for all prompts or one per prompt. Outputs keep the prompts' order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        requests = []
        for prompt, p in zip(prompts, params, strict=True):
            text, token_ids = self._tokenize(prompt)
            requests.append((text, token_ids, p))
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate a reply."""
        conversations = cast(
            "Sequence[Sequence[Message]]", [messages] if messages and isinstance(messages[0], dict) else messages
        )
        params = self._params_per_prompt(sampling_params, len(conversations))
        tok = self.engine.tokenizer
        requests: list[tuple[str | None, list[int], SamplingParams]] = []
        for conv, p in zip(conversations, params, strict=True):
            text = tok.apply_chat_template(list(conv), tools=tools, add_generation_prompt=add_generation_prompt,
                                           chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)
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

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"{len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)

    def _run(self, requests: list[tuple[str | None, list[int], SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for text, token_ids, params in requests:
                request_id = str(next(self._ids))
                engine.add_request(request_id, token_ids, params, prompt=text)
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
