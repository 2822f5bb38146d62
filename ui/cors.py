"""Cross-origin access to the API for the web UI's page, and for nothing else.

The page is served on the UI port and calls the API port directly, so the browser treats each call as
cross-origin. The API answers with CORS headers only when the caller's origin is the UI on the same host name
the request was sent to (``Origin: http://H:<ui port>`` with ``Host: H:<api port>``): other web sites a user
visits cannot read API responses through the user's browser.
"""

from __future__ import annotations

from urllib.parse import urlsplit

ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE_S = 600


def _host_port(url: str) -> tuple[str | None, int | None]:
    try:
        parts = urlsplit(url)
        return parts.hostname, parts.port
    except ValueError:  # a malformed port or bracket
        return None, None


def is_ui_origin(origin: str | None, request_host: str, ui_port: int | None) -> bool:
    """Whether ``origin`` (the request's Origin header) is the UI page on the host the API was reached at."""
    if not origin or ui_port is None:
        return False
    origin_host, origin_port = _host_port(origin)
    host, _ = _host_port("//" + request_host)
    return origin_host is not None and origin_host == host and origin_port == ui_port


def cors_headers(origin: str, preflight: bool) -> dict[str, str]:
    """Headers granting ``origin`` access; a preflight (OPTIONS) also lists what the page may send."""
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        headers.update({
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": ALLOWED_HEADERS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        })
    return headers
