"""``/openapi.json``: the routes, their request schemas (generated from the pydantic models the server validates
with, so the document cannot drift from the checks) and the OpenAI error shape every 4xx/5xx uses."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel

from candle_vllm import __version__
from candle_vllm.api.responses_input import ResponsesRequest
from candle_vllm.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)

_REF = "#/components/schemas/{model}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

_POSTS: dict[str, tuple[type[BaseModel], str, str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, "Chat completion (JSON, or SSE when stream is true)",
                             "application/json"),
    "/v1/completions": (CompletionRequest, "Text completion (JSON, or SSE when stream is true)", "application/json"),
    "/v1/responses": (ResponsesRequest, "Responses API (JSON, or its SSE events when stream is true)",
                      "application/json"),
    "/v1/embeddings": (EmbeddingRequest, "Embeddings: the last token's final hidden state, L2-normalised",
                       "application/json"),
    "/tokenize": (TokenizeRequest, "Token ids of a prompt or of rendered chat messages", "application/json"),
    "/detokenize": (DetokenizeRequest, "Text of token ids", "application/json"),
}

_GETS: dict[str, tuple[str, str]] = {
    "/v1/models": ("Models served", "application/json"),
    "/health": ("200 while serving, 503 while draining", "text/plain"),
    "/ping": ("/health under SageMaker's name (GET or POST)", "text/plain"),
    "/load": ("Requests in flight: {server_load}", "application/json"),
    "/version": ("Server version", "application/json"),
    "/metrics": ("Prometheus metrics (vLLM names)", "text/plain"),
    "/tokenizer_info": ("Special tokens and chat template of the tokenizer", "application/json"),
    "/openapi.json": ("This document", "application/json"),
}


def _errors(*statuses: int) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    return {str(s): {"description": "OpenAI-shaped error", "content": {"application/json": {"schema": ref}}}
            for s in statuses}


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server (built once)."""
    components: dict[str, Any] = {"ErrorResponse": _ERROR}
    paths: dict[str, Any] = {}
    for path, (model, summary, ctype) in _POSTS.items():
        schema = model.model_json_schema(ref_template=_REF)
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        body = {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=model.__name__)}}}}
        ok = {"description": summary, "content": {ctype: {"schema": {"type": "object"}}}}
        paths[path] = {"post": {"summary": summary, "requestBody": body,
                                "responses": {"200": ok, **_errors(400, 401, 404, 413, 415, 503)}}}
    for path, (summary, ctype) in _GETS.items():
        schema = {"type": "string"} if ctype == "text/plain" else {"type": "object"}
        ok = {"description": summary, "content": {ctype: {"schema": schema}}}
        responses = {"200": ok, **_errors(401)}
        if path in ("/health", "/ping"):
            responses["503"] = {"description": "draining"}
        paths[path] = {"get": {"summary": summary, "responses": responses}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "candle-vllm OpenAI-compatible API", "version": __version__},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
