"""Reading a request body at the HTTP edge: bounded in size, JSON, numbers in bounds.

One reader for the frontends and the router, so both refuse the same bodies:
413 past the size limit (known from Content-Length or found while streaming, without
buffering the rest), 400 for a body that is not JSON or carries an out-of-bounds
number (bounds.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from pdserve.edge import bounds


class BodyError(ValueError):
    """A body refused at the edge: `status` 413 or 400, `param` the offending key if known."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


async def read_limited(request: Request, limit: int) -> bytes:
    """The whole body; BodyError 413 as soon as it is known to exceed `limit` bytes."""
    too_large = BodyError(f"request body larger than {limit} bytes", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large  # stop reading: the rest is never buffered
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> Any:
    """The parsed JSON body (any JSON value); BodyError 413 or 400."""
    raw = await read_limited(request, limit)
    try:
        return bounds.loads(raw)
    except bounds.BoundsError as e:
        raise BodyError(str(e), param=e.param) from e
    except ValueError as e:
        raise BodyError(f"invalid JSON body: {e}") from e
