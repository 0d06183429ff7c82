"""OpenAI-style error bodies and the client-gone signal, for the frontends and the router."""

from __future__ import annotations

from typing import Any


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    """`{"error": {message, type, param, code}}`, the OpenAI error shape every route returns."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ClientGone(Exception):
    """The client disconnected before the response was complete."""
