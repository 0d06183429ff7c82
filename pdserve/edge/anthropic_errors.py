"""Anthropic's error shape, for the Messages routes (`/v1/messages...`) of the frontends
and the router."""

from __future__ import annotations

from typing import Any

ANTHROPIC_PATHS = ("/v1/messages",)  # routes that answer in Anthropic's error shape


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def anthropic_error_body(type_: str, message: str) -> dict[str, Any]:
    """`{"type": "error", "error": {type, message}}`, the shape of Anthropic's API."""
    return {"type": "error", "error": {"type": type_, "message": message}}
