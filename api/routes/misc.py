"""The small routes: models list, health (and SageMaker's ``/ping``), load, version, Prometheus metrics, tokenizer
endpoints, OpenAPI document."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from candle_vllm import __version__
from candle_vllm.api import metrics as metrics_mod
from candle_vllm.api.openapi import openapi_document
from candle_vllm.api.prompts import check_token_ids, render_chat
from candle_vllm.api.routes.common import check_model, get_state, in_worker, read_json
from candle_vllm.api.schemas import DetokenizeRequest, TokenizeRequest, parse_request

bp = Blueprint("misc", __name__)


def _model_card(name: str) -> dict[str, Any]:
    state = get_state()
    return {"id": name, "object": "model", "created": state.created, "owned_by": "candle-vllm",
            "root": name, "parent": None, "max_model_len": state.engine.max_model_len}


@bp.get("/v1/models")
async def list_models() -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(name) for name in get_state().model_names]}


@bp.get("/v1/models/<path:model>")
async def get_model(model: str) -> dict[str, Any]:
    return _model_card(check_model(get_state(), model))


@bp.get("/health")
@bp.route("/ping", methods=["GET", "POST"])  # vLLM's SageMaker alias of /health
async def health() -> Response:
    """200 with an empty body while the server takes requests; 503 once it drains (load balancers move on)."""
    if get_state().draining:
        return Response("", status=503, headers={"Retry-After": "5"})
    return Response("", status=200)


@bp.get("/load")
async def load() -> dict[str, int]:
    """vLLM's ``/load``: how many requests are in flight, for a load balancer choosing the least busy replica."""
    return {"server_load": get_state().num_active}


@bp.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@bp.get("/metrics")
async def metrics() -> Response:
    state = get_state()
    return Response(state.metrics.render(state.engine.stats()), status=200,
                    content_type=metrics_mod.CONTENT_TYPE)


def _token_ids(tokenizer: Any, req: TokenizeRequest, tools: list[dict[str, Any]] | None,
               trust_template: bool) -> list[int]:
    """The ids of the request's prompt or rendered messages (runs in a worker thread)."""
    if req.messages is not None:
        text = render_chat(tokenizer, req, tools, trust_template=trust_template)
        return tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    return tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens is not False)


@bp.post("/tokenize")
async def tokenize() -> dict[str, Any]:
    state = get_state()
    req = parse_request(TokenizeRequest, await read_json())
    check_model(state, req.model)
    tokenizer = state.engine.tokenizer
    tools = req.tools or state.mcp_tools()  # what a chat request with these messages would offer
    ids = await in_worker(state, _token_ids, tokenizer, req, tools, state.config.trust_request_chat_template)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [tokenizer.id_to_piece(t) for t in ids]
    return body


@bp.post("/detokenize")
async def detokenize() -> dict[str, Any]:
    state = get_state()
    req = parse_request(DetokenizeRequest, await read_json())
    check_model(state, req.model)
    tokenizer = state.engine.tokenizer
    check_token_ids(req.tokens, tokenizer.vocab_size, "tokens")
    return {"prompt": await in_worker(state, tokenizer.decode, req.tokens, False)}


@bp.get("/tokenizer_info")
async def tokenizer_info() -> dict[str, Any]:
    """What lm-eval's ``tokenizer_backend=auto`` needs to use the server's tokenizer instead of the hub."""
    state = get_state()
    tokenizer = state.engine.tokenizer

    def piece(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_piece(token_id)

    return {"tokenizer_class": "PreTrainedTokenizerFast", "vocab_size": tokenizer.vocab_size,
            "model_max_length": state.engine.max_model_len,
            "eos_token": piece(tokenizer.eos_token_id), "bos_token": piece(tokenizer.bos_token_id),
            "pad_token": piece(tokenizer.pad_token_id), "add_bos_token": tokenizer.add_bos,
            "chat_template": tokenizer.chat_template}


@bp.get("/openapi.json")
async def openapi() -> dict[str, Any]:
    return openapi_document()

