"""Unknown routes (404) and wrong methods (405) in the OpenAI error shape, for the frontends
and the router: an OpenAI client reads `error.message`, which names the route, where
FastAPI's default `{"detail": "Not Found"}` says nothing it shows. Each is logged once,
at warning: a client that calls a route this server lacks (an API it does not serve)
is otherwise invisible in the server's log."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from pdserve.edge.errors import error_body

log = logging.getLogger("pdserve.http")


def route_error_message(method: str, path: str, status: int, allow: str | None) -> str:
    if status == 404:
        return f"Invalid URL ({method} {path}): this server has no such route"
    return f"Method {method} is not allowed on {path} (allowed: {allow or 'none'})"


def add_route_errors(app: FastAPI) -> None:
    async def on_http_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, HTTPException)
        headers = dict(e.headers or {})
        if e.status_code in (404, 405):
            message = route_error_message(request.method, request.url.path, e.status_code,
                                          headers.get("Allow"))  # fmt: skip
            log.warning("%s: %s", e.status_code, message)
        else:
            message = str(e.detail)
        body = error_body(message, "invalid_request_error", None, e.status_code)
        return JSONResponse(body, e.status_code, headers=headers)

    app.add_exception_handler(HTTPException, on_http_error)
