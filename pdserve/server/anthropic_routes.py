"""`POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API) on the
chat path: the body becomes a chat completions body (anthropic_api.py), runs as one
(chat_bridge.py) and is answered as a message or its event stream
(anthropic_format.py). Every error of these routes has Anthropic's shape."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.edge.stamps import arrival_stamps
from pdserve.server.anthropic_api import RENAMES, CountTokensIn, MessagesIn
from pdserve.server.anthropic_format import MessageEvents, MessageShell, error_response
from pdserve.server.chat_bridge import AnswerFailed, ChatRun, answer, pieces, prepare, start
from pdserve.server.engine_client import EngineDead
from pdserve.server.generation import Frontend
from pdserve.server.http_util import stream_until_disconnect
from pdserve.server.jobs import OVERLOADED_RETRY_AFTER_S, Delta, RequestError
from pdserve.server.openai_api import ChatIn
from pdserve.server.openai_parse import chat_prompt_ids, parse_body, read_body
from pdserve.server.openai_routes import tool_parser
from pdserve.server.server_config import ServerConfig

log = logging.getLogger(__name__)


def register(app: FastAPI, fe: Frontend, cfg: ServerConfig) -> None:
    parser = tool_parser(fe, cfg)

    @app.post("/v1/messages")
    async def create(request: Request) -> Response:
        try:
            stamps = arrival_stamps(request.headers)
            body = await read_body(request, MessagesIn, cfg)
            run = prepare(fe, cfg, body.to_chat(), stamps, parser, RENAMES)
            shell = MessageShell(cfg.model_name)
            if body.stream:
                events = _events(fe, run, start(fe, run), MessageEvents(shell))
                return StreamingResponse(stream_until_disconnect(request, events),
                                         media_type="text/event-stream")  # fmt: skip
            return JSONResponse(shell.message(await answer(request, fe, run)))
        except RequestError as e:
            return refused(e)
        except EngineDead as e:
            return error_response(503, f"engine unavailable: {e}")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            body = await read_body(request, CountTokensIn, cfg)
            chat = parse_body(ChatIn, body.to_chat(), cfg)
            return JSONResponse({"input_tokens": len(chat_prompt_ids(fe, chat))})
        except RequestError as e:
            return refused(e)


def refused(e: RequestError) -> Response:
    r = error_response(e.status, e.message)
    if isinstance(e, AnswerFailed) and e.overloaded:
        r.headers["Retry-After"] = str(OVERLOADED_RETRY_AFTER_S)
    return r


async def _events(
    fe: Frontend, run: ChatRun, deltas: AsyncIterator[Delta], ev: MessageEvents
) -> AsyncIterator[str]:
    for e in ev.start(run.prompt_tokens):
        yield e
    gen = pieces(fe, run, deltas)
    try:
        async for p in gen:
            for e in ev.feed(p, run.fmt.completion_tokens):
                yield e
    except AnswerFailed as e:
        yield ev.error(e.status, e.message)
    except Exception as e:  # NOTE: an error event ends the stream, never a cut mid-body
        log.exception("stream failed")
        yield ev.error(500, f"internal error: {type(e).__name__}: {e}")
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
