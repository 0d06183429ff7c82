"""The one error a GGUF conversion raises for a file it cannot serve exactly (its own
module, so the per-architecture entries can raise it without importing the converter)."""

from __future__ import annotations


class GGUFError(ValueError):
    """A GGUF file pdserve cannot serve exactly; the message names what and why."""
