"""``POST /invocations``: vLLM's SageMaker entry point, which serves a body by its shape: ``messages`` as a chat
completion, ``prompt`` as a completion, ``input`` as embeddings -- or as a Responses request when the body has a
field only that API has (SageMaker sends every request to this one path)."""

from __future__ import annotations

from typing import Any

from quart import Blueprint

from candle_vllm.api.errors import bad_request
from candle_vllm.api.routes import chat, completions, embeddings, responses
from candle_vllm.api.routes.common import read_json

bp = Blueprint("invocations", __name__)

_BY_FIELD = (("messages", chat.chat_completions), ("prompt", completions.completions), ("input", embeddings.embeddings))
_RESPONSES_ONLY = frozenset({"instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning",
                             "temperature", "top_p", "stream", "store", "previous_response_id"})


@bp.post("/invocations")
async def invocations() -> Any:
    body = await read_json()  # quart keeps the body: the handler reads it again
    if isinstance(body, dict):
        if "input" in body and _RESPONSES_ONLY & body.keys():
            return await responses.responses()
        for field, handler in _BY_FIELD:
            if field in body:
                return await handler()
    raise bad_request("/invocations serves a chat completion (a body with messages), a completion (prompt) or "
                      "embeddings (input); the body has none of these fields")
