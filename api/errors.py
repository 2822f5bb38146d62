"""OpenAI-shaped errors: every failure the server reports, before or after a stream started, has the body
``{"error": {"message", "type", "param", "code"}}`` so the official SDK raises its matching exception class
(BadRequestError for 400, AuthenticationError for 401, NotFoundError for 404, ...)."""

from __future__ import annotations

from typing import Any

# OpenAI's ``type`` strings per HTTP status; the SDK picks its exception class from the status alone.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI error body.

    Raise it anywhere inside a request handler; the app's error handler turns it into the response.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body, also used as the payload of an error chunk inside a stream."""
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` for ``status``; ``type`` follows OpenAI's naming for that status class."""
    kind = _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request itself is wrong; the message says what and, where it helps, how to fix it."""
    return APIError(400, message, param=param, code=code)


def service_unavailable(message: str, retry_after_s: int = 1) -> APIError:
    """503 with Retry-After: the server is draining or overloaded, the same request may succeed later."""
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": str(retry_after_s)})
