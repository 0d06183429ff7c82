"""Graceful drain of a frontend on SIGTERM (a rolling update, `kubectl delete pod`).

    SIGTERM ─▶ draining: /health 503 {"status": "draining"}, new generations 503 +
               Retry-After (a router sends them elsewhere), those in flight go on
            ─▶ none in flight, or `drain_timeout_s` passed ─▶ the usual shutdown
               (uvicorn's, then the engine's), exit 0

A second SIGTERM, or SIGINT (Ctrl-C, and `pdserve up` stopping its stack), shuts
down at once as before. Generations in flight at the deadline are cut: a router
migrates them (docs/reliability.md).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

log = logging.getLogger("pdserve.drain")

GENERATION_PATHS = frozenset(
    {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
)


class Drain:
    """The drain state of one frontend, and the ASGI middleware that counts and refuses."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.since: float | None = None  # monotonic time of the SIGTERM
        self.in_flight = 0  # generation requests whose response has not ended

    @property
    def draining(self) -> bool:
        return self.since is not None

    def start(self) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.warning("SIGTERM: draining (%d requests in flight, at most %.0fs), "
                        "new requests get 503", self.in_flight, self.timeout_s)  # fmt: skip

    def done(self) -> bool:
        """True once a drain has nothing left to wait for (or waited long enough)."""
        if self.since is None:
            return False
        return self.in_flight == 0 or time.monotonic() - self.since >= self.timeout_s

    def middleware(self, app: Any) -> Any:
        async def asgi(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
                return await app(scope, receive, send)
            if self.draining:
                return await _refuse(send)
            self.in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                self.in_flight -= 1

        return asgi


async def _refuse(send: Any) -> None:
    body = json.dumps({"error": {"message": "server is draining (shutting down)",
                                 "type": "server_error", "param": None, "code": 503}}).encode()  # fmt: skip
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
