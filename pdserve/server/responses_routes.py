"""`POST /v1/responses` (OpenAI's Responses API) on the chat path: the body becomes a
chat completions body (responses_api.py), runs as one (chat_bridge.py) and is answered
as a response object or its event stream (responses_format.py).

Responses are not stored, so `GET /v1/responses/{id}` (and its delete, cancel and
input items) answers 404 saying so.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.edge.stamps import arrival_stamps
from pdserve.server.chat_bridge import AnswerFailed, ChatRun, answer, pieces, prepare, start
from pdserve.server.generation import Frontend
from pdserve.server.http_util import check_api_key, error_response, stream_until_disconnect
from pdserve.server.jobs import OVERLOADED_RETRY_AFTER_S, Delta, RequestError
from pdserve.server.openai_parse import read_body
from pdserve.server.openai_routes import tool_parser
from pdserve.server.responses_api import RENAMES, ResponsesIn
from pdserve.server.responses_format import ResponseEvents, ResponseShell
from pdserve.server.server_config import ServerConfig

log = logging.getLogger(__name__)
NOT_STORED = ("response {id!r} not found: this server does not store responses (store "
              "is refused; send the conversation as input items)")  # fmt: skip


def register(app: FastAPI, fe: Frontend, cfg: ServerConfig) -> None:
    parser = tool_parser(fe, cfg)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        stamps = arrival_stamps(request.headers)
        body = await read_body(request, ResponsesIn, cfg)
        run = prepare(fe, cfg, body.to_chat(), stamps, parser, RENAMES)
        shell = ResponseShell(body, cfg.model_name)
        if body.stream:
            events = _events(fe, run, start(fe, run), ResponseEvents(shell))
            return StreamingResponse(stream_until_disconnect(request, events),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            a = await answer(request, fe, run)
        except AnswerFailed as e:
            return failed_response(e)
        return JSONResponse(shell.response(a))

    async def not_stored(request: Request, response_id: str) -> Response:
        check_api_key(request, cfg.api_key)
        raise RequestError(NOT_STORED.format(id=response_id), "response_id", status=404)

    app.add_api_route("/v1/responses/{response_id}", not_stored, methods=["GET", "DELETE"])
    for tail in ("cancel", "input_items"):
        app.add_api_route(f"/v1/responses/{{response_id}}/{tail}", not_stored,
                          methods=["GET", "POST"])  # fmt: skip


def failed_response(e: AnswerFailed) -> Response:
    r = error_response(e.status, e.message)
    if e.overloaded:
        r.headers["Retry-After"] = str(OVERLOADED_RETRY_AFTER_S)
    return r


async def _events(
    fe: Frontend, run: ChatRun, deltas: AsyncIterator[Delta], ev: ResponseEvents
) -> AsyncIterator[str]:
    for e in ev.start():
        yield e
    gen = pieces(fe, run, deltas)
    try:
        async for p in gen:
            for e in ev.feed(p, run.prompt_tokens, run.fmt.completion_tokens):
                yield e
    except AnswerFailed as e:
        for x in ev.error(e.message, e.status):
            yield x
    except Exception as e:  # NOTE: an error event ends the stream, never a cut mid-body
        log.exception("stream failed")
        for x in ev.error(f"internal error: {type(e).__name__}: {e}", 500):
            yield x
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
