"""Request bodies the router sends: bootstrap fields, rooms, error bodies."""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from pdserve.router.workers import Worker

MAX_SEQUENCES = 1024  # batch × n of one request; more is refused before any room is drawn


def num_sequences(path: str, body: dict[str, Any]) -> int | None:
    """Sequences one request makes (batch × n), or None for a single one (scalar room).

    Raises ValueError past MAX_SEQUENCES (the workers would refuse it anyway)."""
    n = body.get("n", 1) if path.startswith("/v1/") else _sampling_n(body)
    batch = _batch_size(body) if path == "/generate" else None
    count = (batch or 1) * (n if isinstance(n, int) and n > 1 else 1)
    if count > MAX_SEQUENCES:
        raise ValueError(f"a request may make at most {MAX_SEQUENCES} sequences (batch × n)")
    return count if batch is not None or count > 1 else None


def _sampling_n(body: dict[str, Any]) -> Any:
    params = body.get("sampling_params")
    return params.get("n", 1) if isinstance(params, dict) else 1


def _batch_size(body: dict[str, Any]) -> int | None:
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def with_bootstrap(path: str, body: dict[str, Any], prefill: Worker) -> dict[str, Any]:
    """A copy of `body` with the bootstrap fields and a `rid` (kept if the client set one;
    none for a batch).

    `bootstrap_room` is a fresh random 63-bit int, or a list of distinct ones when
    the request makes several sequences (batch and/or n > 1), one per sequence.
    """
    out = dict(body)
    count = num_sequences(path, body)
    if count is None:
        out["bootstrap_room"] = secrets.randbits(63)
    else:
        out["bootstrap_room"] = _distinct_rooms(count)
    out["bootstrap_host"] = prefill.host
    out["bootstrap_port"] = prefill.bootstrap_port
    # one rid per request, so the router can abort its legs by it (a frontend names a
    # request's n > 1 samples under it); a batch would need one per prompt: left out
    if "rid" not in out and not (path == "/generate" and _batch_size(body) is not None):
        out["rid"] = f"pdr-{uuid.uuid4().hex}"
    return out


def _distinct_rooms(count: int) -> list[int]:
    rooms: set[int] = set()
    while len(rooms) < count:
        rooms.add(secrets.randbits(63))
    return list(rooms)
