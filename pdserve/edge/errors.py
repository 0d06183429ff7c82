"""OpenAI-style (and, for the Messages routes, Anthropic-style) error bodies and the client-gone signal, for the frontends and the router."""

from __future__ import annotations

from typing import Any


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    """`{"error": {message, type, param, code}}`, the OpenAI error shape every route returns."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ANTHROPIC_PATHS = ("/v1/messages",)  # routes that answer in Anthropic's error shape


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def anthropic_error_body(type_: str, message: str) -> dict[str, Any]:
    """`{"type": "error", "error": {type, message}}`, the shape of Anthropic's API."""
    return {"type": "error", "error": {"type": type_, "message": message}}


class ClientGone(Exception):
    """The client disconnected before the response was complete."""
