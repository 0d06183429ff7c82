"""The bearer API key, checked the same way by the frontends and the router.

`RequireKey` wraps a whole app, so every route needs the key except those named
here (`/health`, `/metrics` where `metrics_public` says so, and the static files an app
names in `open_paths`, such as the router's console page): a route added later
is covered without anyone remembering to check. CORS preflights (OPTIONS) pass: a
browser sends them without credentials, and a CORS middleware added after this one
(so outside it) answers them. It is plain ASGI (no Starlette
BaseHTTPMiddleware), so streams and disconnect detection pass through untouched.

Every comparison is constant-time (`hmac.compare_digest`) on the header's raw bytes,
so the time a refusal takes says nothing about how much of a guessed key was right,
and a header with non-ASCII bytes is a 401 like any other wrong key.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from pdserve.edge.errors import error_body

OPEN_PATHS = frozenset({"/health"})  # served without the key (orchestrators' probes)
METRICS_PATH = "/metrics"  # open only where `metrics_public` says so
_UNAUTHORIZED = json.dumps(
    error_body("invalid or missing API key", "authentication_error", None, 401)
).encode()


def key_matches(authorization: bytes | str | None, api_key: str) -> bool:
    """True when the `Authorization` header value is `Bearer <api_key>` (scheme in any case).
    A `str` header is taken as decoded latin-1, as ASGI servers and Starlette decode them."""
    raw = authorization or b""
    if isinstance(raw, str):
        raw = raw.encode("latin-1", "replace")
    scheme, _, token = raw.partition(b" ")
    # NOTE: the digest comparison runs whatever the scheme, so a wrong scheme and a
    # wrong key take the same time
    same = hmac.compare_digest(token.strip(), api_key.encode())
    return same and scheme.lower() == b"bearer"


def needs_key(
    path: str, metrics_public: bool = False, open_paths: frozenset[str] = frozenset()
) -> bool:
    """Whether a request for `path` must carry the key (when a key is set)."""
    if path in OPEN_PATHS or path in open_paths:
        return False
    return not (metrics_public and path == METRICS_PATH)


class RequireKey:
    """ASGI middleware: 401 (OpenAI error body) for an HTTP request to a path that
    `needs_key` without `Authorization: Bearer <api_key>`. No key set: lets all through."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        metrics_public: bool = False,
        open_paths: frozenset[str] = frozenset(),  # exact paths; static files holding no secret
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics_public = metrics_public
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.api_key:
            return await self.app(scope, receive, send)
        # NOTE: a CORS preflight (OPTIONS) carries no key by design; no route does work on it
        if scope["method"] == "OPTIONS" or not needs_key(
            scope["path"], self.metrics_public, self.open_paths
        ):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), None)
        if key_matches(header, self.api_key):
            return await self.app(scope, receive, send)
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(_UNAUTHORIZED)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})  # fmt: skip
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
