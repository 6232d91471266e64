"""The answers the proxy gives itself (a body too large, an engine that ended or is not restarting, a client refused):
each API's own error shape, so that the client shows the message, and Retry-After where the status asks a client to
come back (429, 503)."""

from __future__ import annotations

from aiohttp import web

RETRY_STATUSES = (429, 503)


def error_body(label: str, status: int, message: str) -> dict:
    """label: the API ("anthropic", "openai", or "other" for every other path, which gets OpenAI's shape)."""
    if label == "anthropic":
        kind = "rate_limit_error" if status == 429 else "api_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": "proxy_error", "code": status}}


def error_response(label: str, status: int, message: str, retry_after: int = 1) -> web.Response:
    return web.json_response(error_body(label, status, message), status=status,
                             headers={"Retry-After": str(retry_after)} if status in RETRY_STATUSES else None)
