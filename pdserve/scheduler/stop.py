"""Stop conditions checked by the engines on each new token (stop strings are the
detokenizer's job: they need text)."""

from __future__ import annotations

from pdserve.scheduler.request import Req


def check_stop(req: Req, token: int, eos_ids: tuple[int, ...]) -> tuple[str, int | None] | None:
    """(finish_reason, matched token) once `req` must stop after `token`, else None."""
    p = req.params
    if token in p.stop_token_ids:
        return "stop", token
    if not p.ignore_eos and token in eos_ids:
        return "stop", token
    if len(req.output_ids) >= p.max_tokens:
        return "length", None
    return None
