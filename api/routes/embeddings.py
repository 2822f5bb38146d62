"""``POST /v1/embeddings``: the vectors of text or token-id inputs (one or a batch), as float lists or base64.

Each input runs as one engine embedding request (``SamplingParams.embed``: the prompt and one token, which the
answer leaves out). Its vector is the final-normed hidden state of its last token, L2-normalised: last-token
pooling, what decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) are trained for and what vLLM
pools such models with. ``dimensions`` keeps the first d components and normalises them again (Matryoshka
truncation) for models declared to be trained for it (config.json's ``is_matryoshka`` /
``matryoshka_dimensions``, or ``--hf-overrides``), as vLLM allows it; other models, or more than the hidden size,
get a 400. vLLM's pooling extras that would change the vector and are not built are refused, not ignored.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np
from quart import Blueprint

from candle_vllm.api.errors import APIError, bad_request, service_unavailable
from candle_vllm.api.generation import EngineRequest
from candle_vllm.api.prompts import UnbuiltExtras, check_token_ids, refuse_unbuilt_extras, truncated_prompt
from candle_vllm.api.routes.common import check_model, collect, get_state, in_worker, now_s, read_json, submit
from candle_vllm.api.schemas import EmbeddingRequest, parse_request
from candle_vllm.api.state import ServerState
from candle_vllm.pyengine.loader.pooling import truncated
from candle_vllm.pyengine.outputs import RequestOutput
from candle_vllm.pyengine.pooling_params import embedding_keep
from candle_vllm.pyengine.sampling.params import SamplingParams

bp = Blueprint("embeddings", __name__)
_PARAMS = SamplingParams(max_tokens=1, temperature=0, embed=True)
# vLLM's embedding extras that would change the vector, with the value that changes nothing.
_UNBUILT: UnbuiltExtras = {
    "normalize": (True, "normalize false is not supported: the vectors are always L2-normalised"),
    "use_activation": (True, "use_activation false is not supported: the vectors are always L2-normalised"),
    "embed_dtype": ("float32", "embed_dtype other than float32 is not supported"),
    "endianness": (frozenset({"native", "little"}), "big-endian vectors are not supported (native is little here)"),
    "messages": (None, "chat-style embedding inputs (messages) are not supported; send the text as input"),
}


def _token_ids(req: EmbeddingRequest, tokenizer: Any, max_model_len: int) -> list[list[int]]:
    """Each input's ids (text tokenized with the model's special tokens unless ``add_special_tokens`` is false,
    as vLLM does), cut to ``truncate_prompt_tokens``, checked against the vocabulary and the context (runs in a
    worker thread)."""
    out = []
    keep = embedding_keep(req.truncate_prompt_tokens, max_model_len)
    for i, item in enumerate(req.inputs()):
        param = "input" if not isinstance(req.input, list) or isinstance(req.input[0], int) else f"input.{i}"
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
        else:
            check_token_ids(item, tokenizer.vocab_size, param)
            ids = item
        ids = truncated_prompt(ids, keep, max_model_len)
        if not ids:
            raise bad_request("the input is empty after tokenization", param=param)
        if len(ids) >= max_model_len:  # the internal token needs its place in the context
            raise bad_request(f"the input has {len(ids)} tokens and this server embeds at most {max_model_len - 1} "
                              "(its context length minus one); shorten the input", param=param,
                              code="context_length_exceeded")
        out.append(ids)
    return out


def _vector(state: ServerState, out: RequestOutput | None, dimensions: int | None) -> list[float]:
    """The input's vector (the first ``dimensions`` components, normalised again, when asked)."""
    if out is None or out.embedding is None:  # aborted: the server is draining, or a step failed
        if state.draining:
            raise service_unavailable("the server is shutting down; retry on another replica", retry_after_s=5)
        raise APIError(500, "the engine ended the embedding request without its vector (a step failed); see the "
                            "server log", code="internal_error")
    return truncated(out.embedding, dimensions)


@bp.post("/v1/embeddings")
async def embeddings() -> dict[str, Any]:
    state = get_state()
    req = parse_request(EmbeddingRequest, await read_json())
    model = check_model(state, req.model)
    refuse_unbuilt_extras(req, _UNBUILT)
    hidden = state.engine.model_config.hidden_size
    if req.dimensions is not None:
        try:
            state.engine.matryoshka.check(model, req.dimensions)
        except ValueError as e:
            raise bad_request(str(e), param="dimensions") from e
        if req.dimensions > hidden:
            raise bad_request(f"dimensions {req.dimensions} exceeds this model's embedding size ({hidden}); ask "
                              f"for at most {hidden}", param="dimensions")
    tokenizer = state.engine.tokenizer
    inputs = await in_worker(state, _token_ids, req, tokenizer, state.engine.max_model_len)
    request_id = f"embd-{uuid.uuid4().hex}"
    created = now_s()
    requests = [EngineRequest(f"{request_id}-{i}", ids, _PARAMS) for i, ids in enumerate(inputs)]
    batch, outputs, _ = await submit(state, requests, False)
    try:
        last = await collect(outputs, len(requests))
    finally:
        await batch.close()
    data = []
    for i, out in enumerate(last):
        v = _vector(state, out, req.dimensions)
        value: Any = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() \
            if req.encoding_format == "base64" else v
        data.append({"object": "embedding", "index": i, "embedding": value})
    prompt_tokens = sum(len(ids) for ids in inputs)
    return {"id": request_id, "object": "list", "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
