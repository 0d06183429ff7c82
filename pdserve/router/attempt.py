"""A request through the router across its attempts: `Run` is the client's request,
`Attempt` one (prefill, decode) pair serving it.

    Run ── Attempt 0 (pair A) ──✗ decode died / stuck / failed
       └── Attempt 1 (pair B, body + resume_ids = the tokens the client has) ── ...

Invariants: an Attempt's `finish` releases its lease and rid exactly once (detached:
inside a cancelled request task every await is cancelled again); a Run retries only
while nothing reached the client, or, for a stream, when the rest can be continued
exactly after the tokens already sent (`resumable`), at most `limit` times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from pdserve.router.http1 import Http1Response
from pdserve.router.legs import LegError
from pdserve.router.workers import Worker

log = logging.getLogger(__name__)

PREFILL_GRACE_S = 30.0  # after the decode finished, the lease waits this long for the prefill

# The fields a stream may carry and still be continued token for token on another pair
# from its prompt plus the tokens sent (Job.resume on the workers). Anything else is not
# migrated once tokens went out: a seed (the generator's state after k tokens is not
# reproduced), penalties (they count the whole output, the resumed part would be prompt),
# logprobs (a prompt's and an output token's are not the same thing), structured output
# (the grammar's state), n > 1 and batches, min_tokens. Unseeded sampling continues as
# a sample of the same distribution.
_RESUMABLE = frozenset(
    "model prompt messages text input_ids max_tokens max_completion_tokens temperature top_p "
    "top_k min_p stop stop_token_ids ignore_eos stream stream_options rid user tools "
    "tool_choice parallel_tool_calls chat_template_kwargs metadata sampling_params "
    "resume_ids".split()
)
_RESUMABLE_SAMPLING = frozenset(
    "max_new_tokens temperature top_p top_k min_p stop stop_token_ids ignore_eos".split()
)


# Those fields at these values change nothing (clients send defaults explicitly)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1, None), "seed": (None,), "logprobs": (None, False), "top_logprobs": (None, 0),
    "return_logprob": (False,), "echo": (False,), "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0), "repetition_penalty": (None, 1),
}  # fmt: skip


def _plain(fields: dict[str, Any], allowed: frozenset[str]) -> bool:
    return all(k in allowed or v in _NEUTRAL.get(k, ()) for k, v in fields.items())


def resumable(path: str, body: dict[str, Any]) -> bool:
    """True when a stream of `body` may continue on another pair after tokens went out."""
    sp = body.get("sampling_params", {})
    if not _plain(body, _RESUMABLE) or not isinstance(sp, dict):
        return False
    if not _plain(sp, _RESUMABLE_SAMPLING):
        return False
    prompt = body.get("prompt") if path == "/v1/completions" else body.get("text")
    batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    ids = body.get("input_ids")
    return not batch and not (isinstance(ids, list) and ids and isinstance(ids[0], list))


class Run:
    """One client request across its attempts."""

    def __init__(self, path: str, body: dict[str, Any], headers: dict, limit: int) -> None:
        self.path, self.body, self.headers, self.limit = path, body, headers, limit
        self.stream = bool(body.get("stream"))
        self.resumable = self.stream and resumable(path, body)
        self.attempts = 0  # retries so far
        self.avoid: set[Worker] = set()  # workers an attempt failed on
        self.ids: list[int] = []  # token ids whose events reached the client
        self.sent = False  # any event reached the client
        self.done = False  # the stream's [DONE] went out

    def retry(self, e: LegError, a: Attempt | None) -> bool:
        """Whether to go on with another attempt after `e` (counts it)."""
        if a is not None:
            self.avoid.add(a.decode)
            if e.prefill:
                self.avoid.add(a.prefill)
        if self.attempts >= self.limit or not e.retryable:
            return False
        if self.sent and not (self.resumable and self.ids and not self.done):
            return False
        self.attempts += 1
        return True

    def attempt_body(self, rid: Any) -> dict[str, Any]:
        """The body of the next attempt (before with_bootstrap): its own rid (the workers
        may still hold the last one) and the tokens the client has."""
        body = dict(self.body)
        if isinstance(rid, str) and self.attempts:  # (a rid that is no string: the workers' 400)
            body["rid"] = f"{rid}-m{self.attempts}"
        if self.ids:  # after those the client itself resumed from, if any
            body["resume_ids"] = list(self.body.get("resume_ids") or ()) + self.ids
        return body


class Attempt:
    """One pair serving a Run; `finish` releases everything once."""

    def __init__(self, proxy: Any, prefill: Worker, decode: Worker, body: dict, lease: Any,
                 headers: dict, key: Any) -> None:  # fmt: skip
        self.proxy, self.prefill, self.decode, self.body = proxy, prefill, decode, body
        self.lease = lease
        self.headers = headers  # the legs' own (the key a worker wants for the abort, too)
        # the client's rid, under which /abort_request finds this attempt
        self.key = key if isinstance(key, str) else None
        rid = body.get("rid")
        self.rid = rid if isinstance(rid, str) else None  # the workers'
        self.tasks: list[asyncio.Future] = []
        self.decode_resp: Http1Response | None = None
        self.progress = time.monotonic()  # last event from the decode (watchdog)
        self.stream = False  # the decode's body is being relayed (the stall clock runs)
        self.tripped: str | None = None  # why the watchdog gave up on this attempt
        self.trip_fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._finished = False
        if self.key is not None:
            proxy.in_flight.setdefault(self.key, []).append(self)
        proxy.live.add(self)

    def trip(self, reason: str) -> None:
        """Give up on this attempt: its waits and reads end with LegError(504, reason)."""
        if self.tripped is None and not self._finished:
            self.tripped = reason
            self.trip_fut.set_exception(LegError(504, reason, retryable=True))
            self.trip_fut.exception()  # seen: nobody may be waiting on it
            if self.decode_resp is not None:
                self.decode_resp.abort()

    def finish(self, ok: bool, abort: bool = False) -> None:
        if not self._finished:
            self._finished = True
            self.proxy.live.discard(self)
            self.proxy.spawn(self._cleanup(ok, abort))

    async def _cleanup(self, ok: bool, abort: bool) -> None:
        try:
            if self.tasks:
                await self._settle(ok)
            if abort:
                self.proxy.stats["aborted_total"] += 1
                await self.abort_workers(self.headers)
        finally:  # NOTE: whatever failed above, the lease and the rid are given back
            self._forget()
            self.lease.__exit__(None, None, None)

    async def _settle(self, ok: bool) -> None:
        prefill_task = self.tasks[0]
        if ok and not prefill_task.done():
            await asyncio.wait({prefill_task}, timeout=PREFILL_GRACE_S)
        for task in self.tasks:
            _drain(task)
        if self.decode_resp is not None:
            await self.decode_resp.aclose()
        decode_task = self.tasks[1]
        if decode_task.done() and not decode_task.cancelled() and not decode_task.exception():
            await decode_task.result().aclose()

    def _forget(self) -> None:
        live = self.proxy.in_flight.get(self.key) if self.key is not None else None
        if live is not None and self in live:
            live.remove(self)
            if not live:
                del self.proxy.in_flight[self.key]

    async def abort_workers(self, headers: dict) -> list[dict[str, Any]]:
        """`/abort_request {"rid"}` to this attempt's two workers, by its exact rid."""
        if self.rid is None:
            return []  # legs were cancelled; the workers see the disconnect
        out: list[dict[str, Any]] = []
        for w in (self.prefill, self.decode):
            try:
                r = await self.proxy.client.post(w.url + "/abort_request", json={"rid": self.rid},
                                                 headers=_auth_only(headers), timeout=2.0)  # fmt: skip
                out.append({"url": w.url, "status": r.status_code})
            except httpx.HTTPError as e:
                log.info("abort_request to %s failed: %r", w.url, e)
                out.append({"url": w.url, "error": repr(e)})
        return out


def _drain(task: asyncio.Future) -> None:
    """Cancel `task`, or mark its exception as seen so asyncio does not log it."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


def _auth_only(headers: dict) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() == "authorization"}
