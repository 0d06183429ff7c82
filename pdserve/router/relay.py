"""A decode's SSE stream, block by block, as the router relays it (proxy.py).

    worker:  ": ids 17,4\ndata: {...}\n\n"   ": ids 9\n\n"   "data: [DONE]\n\n"
    client:  "data: {...}\n\n"               (nothing)       "data: [DONE]\n\n"

The router asks the decode for each event's token ids (TOKEN_IDS_HEADER); they come as
an SSE comment line heading the event's block. A block counts only once it arrived
whole, so `Run.ids` are exactly the tokens whose events the client has. A worker's
`data: {"error": ...}` event becomes a LegError (another pair may continue the stream).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from pdserve.router.attempt import Attempt, Run
from pdserve.router.legs import LegError, chunks

TOKEN_IDS_HEADER = "x-pdserve-token-ids"  # as server/openai_format.py's (no import: layers)
_IDS = b": ids "
_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'
# The events after which a worker's stream is complete: chat and completions end with
# [DONE]; the Responses stream with its terminal response event, the Messages stream
# with message_stop (or Anthropic's error event, which ends it too).
_LAST = (_DONE, b"event: response.completed", b"event: response.incomplete",
         b"event: response.failed", b"event: message_stop", b"event: error")  # fmt: skip


def split_block(block: bytes) -> tuple[list[int], bytes]:
    """(token ids, the block without its ids comment, "" when nothing else is left)."""
    if not block.startswith(_IDS):
        return [], block + b"\n\n"
    head, _, rest = block.partition(b"\n")
    ids = [int(t) for t in head[len(_IDS) :].split(b",") if t]
    return ids, (rest + b"\n\n" if rest else b"")


def worker_error(event: bytes) -> LegError:
    """The LegError of a worker's error event (its own body kept for the client)."""
    try:
        body = json.loads(event[len(b"data: ") :])
        code = body["error"].get("code")
    except (ValueError, KeyError, AttributeError):
        body, code = None, None
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    return LegError(status, f"decode stream failed: {event[:300]!r}", body, from_worker=True)


async def events(run: Run, a: Attempt) -> AsyncIterator[bytes]:
    """The decode's events for the client; records their ids in `run`. Raises LegError
    when the stream fails, is tripped (Attempt.trip) or ends before its last event
    (_LAST)."""
    assert a.decode_resp is not None
    buf = b""
    a.stream, a.progress = True, time.monotonic()
    try:
        async for chunk in chunks(a.decode_resp, a.tasks[0]):
            a.progress = time.monotonic()
            buf += chunk
            *blocks, buf = buf.split(b"\n\n")
            outs: list[bytes] = []  # one write to the client per chunk, as it came
            for block in blocks:
                ids, out = split_block(block)
                if out.startswith(_ERROR):
                    if outs:
                        yield b"".join(outs)
                    raise worker_error(out)
                run.ids += ids
                if out:
                    run.sent = True
                    run.done = run.done or out.startswith(_LAST)
                    outs.append(out)
            if outs:
                yield outs[0] if len(outs) == 1 else b"".join(outs)
    except LegError as e:
        if a.tripped is not None:
            raise LegError(504, a.tripped, retryable=True) from e
        raise
    if not run.done:
        raise LegError(502, f"decode {a.decode.url} ended its stream early", retryable=True)
