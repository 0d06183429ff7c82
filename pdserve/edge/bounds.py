"""Numeric bounds of request bodies at the HTTP edge, shared by the frontends and the router.

Everything a body carries crosses msgspec/msgpack (int64) and torch later, so the
edge refuses, before a request is registered anywhere:

    any float            not finite (NaN, ±Infinity, or an overflowing literal like 1e999)
    any integer          outside int64
    seed                 outside [INT64_MIN, SEED_MAX] (sample i of n runs with seed + i)
    bootstrap_room       outside [0, 2**63) (63-bit rooms), one value or a list
    bootstrap_port       outside [0, 65535]

The walk is generic (every route, every nesting level), so a new field is bounded
without a change here; the named rules apply wherever the key appears.
"""

from __future__ import annotations

import json
import math
from typing import Any

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_SAMPLES = 1024  # most sequences one request may make (router_body.MAX_SEQUENCES)
SEED_MAX = INT64_MAX - MAX_SAMPLES
ROOM_MAX = (1 << 63) - 1
MAX_DEPTH = 32  # deeper nesting than any route needs is refused


class BoundsError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _no_constant(name: str) -> Any:
    raise BoundsError(f"{name} is not valid JSON (numbers must be finite)")


def loads(raw: bytes | str) -> Any:
    """Parse a JSON body and check it (raises ValueError; BoundsError for bounds)."""
    data = json.loads(raw, parse_constant=_no_constant)
    check(data)
    return data


def check(data: Any, path: str = "", depth: int = 0) -> None:
    """Raise BoundsError naming the first value of `data` out of bounds."""
    if depth > MAX_DEPTH:
        raise BoundsError(f"JSON nested deeper than {MAX_DEPTH} levels", path or None)
    if isinstance(data, dict):
        for key, value in data.items():
            sub = f"{path}.{key}" if path else str(key)
            _named(str(key), value, sub)
            check(value, sub, depth + 1)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            check(value, f"{path}[{i}]", depth + 1)
    elif isinstance(data, float) and not math.isfinite(data):
        raise BoundsError(f"{path or 'value'}: must be a finite number", path or None)
    elif isinstance(data, int) and not isinstance(data, bool):
        if not INT64_MIN <= data <= INT64_MAX:
            raise BoundsError(f"{path or 'value'}: integer outside int64", path or None)


_RANGES = {
    "seed": (INT64_MIN, SEED_MAX),
    "bootstrap_room": (0, ROOM_MAX),
    "bootstrap_port": (0, 65535),
}


def _named(key: str, value: Any, path: str) -> None:
    bounds = _RANGES.get(key)
    if bounds is None:
        return
    lo, hi = bounds
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, int) and not isinstance(v, bool) and not lo <= v <= hi:
            raise BoundsError(f"{path}: {v} outside [{lo}, {hi}]", path)
