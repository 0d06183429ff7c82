"""A tiny real HTTP server that streams tokens on a fixed clock, for testing
`pdserve bench`: first token `ttft` seconds after the request, then one every
`itl` seconds, in the native, completions and chat SSE formats.

The i-th generation request (in arrival order) follows `faults[i]` when given:
  "ok"     stream normally
  "500"    answer HTTP 500 with an OpenAI-style error body
  "drop"   send `drop_after` tokens, then cut the connection mid-stream
  "hang"   send the headers and nothing more
  "error"  send one token, then an SSE error object
Raw asyncio (one request per connection), in a child process.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import httpx

BREAKDOWN = {"queue": 0.001, "prefill": 0.03, "kv_transfer": 0.015, "decode_admission": 0.004}


class FakeStreamServer:
    """Test-side handle: runs `StreamServer` in a child process (so its clock is
    not disturbed by the GIL of the process under test) on a free loopback port."""

    def __init__(
        self,
        ttft: float = 0.05,
        itl: float = 0.02,
        faults: list[str] | None = None,
        server_counts: bool = True,  # send token counts (usage, meta_info) and ttft_breakdown
        drop_after: int = 3,
    ):
        self.settings = dict(
            ttft=ttft,
            itl=itl,
            faults=faults or [],
            server_counts=server_counts,
            drop_after=drop_after,
        )
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Bodies of the generation requests received so far, in arrival order."""
        return httpx.get(self.url + "/_requests", timeout=10, trust_env=False).json()

    def __enter__(self) -> FakeStreamServer:
        cmd = [sys.executable, __file__, json.dumps(self.settings)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())  # the child prints its port when ready
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)


class StreamServer:
    def __init__(
        self, ttft: float, itl: float, faults: list[str], server_counts: bool, drop_after: int
    ):
        self.ttft, self.itl, self.drop_after = ttft, itl, drop_after
        self.faults = faults
        self.server_counts = server_counts
        self.requests: list[dict[str, Any]] = []  # bodies of generation requests, in order

    async def serve_forever(self) -> None:
        server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
        headers = dict(
            (k.strip().lower(), v.strip())
            for k, v in (line.split(":", 1) for line in head.split("\r\n")[1:] if ":" in line)
        )
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if method == "GET" and path == "/_requests":
            return await _send_json(writer, 200, self.requests)
        if method == "GET" and path == "/v1/models":
            return await _send_json(writer, 200, {"object": "list", "data": [{"id": "fake-model"}]})
        kind = {"/generate": "native", "/v1/completions": "openai"}.get(path)
        kind = kind or ("openai-chat" if path == "/v1/chat/completions" else None)
        if method != "POST" or kind is None:
            return await _send_json(writer, 404, {"error": {"message": f"no route {path}"}})
        req = json.loads(body)
        fault = self.faults[len(self.requests)] if len(self.requests) < len(self.faults) else "ok"
        self.requests.append(req)
        if fault == "500":
            return await _send_json(writer, 500, {"error": {"message": "injected failure"}})
        await self._stream(writer, kind, req, fault)

    async def _stream(self, writer: asyncio.StreamWriter, kind: str, req: dict, fault: str) -> None:
        t0 = asyncio.get_running_loop().time()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        if kind == "openai-chat":  # the role-only first chunk vLLM sends: no content
            await _send_event(writer, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        if fault == "hang":
            await asyncio.sleep(3600)
        n_out = _max_tokens(req)
        loop = asyncio.get_running_loop()
        due = t0 + self.ttft
        for i in range(n_out):
            # Each gap is at least `itl` after the previous token actually went
            # out: a stalled loop delays the rest, it never bunches them (a
            # fixed schedule would catch up and send gaps shorter than `itl`).
            await _sleep_until(due)
            due = max(due, loop.time()) + self.itl
            if fault == "drop" and i == self.drop_after:
                writer.transport.abort()  # no terminating chunk: a cut stream
                return
            if fault == "error" and i == 1:
                await _send_event(writer, {"error": {"message": "injected stream error"}})
                break
            await _send_event(writer, self._token_chunk(kind, req, i, n_out))
        if kind != "native" and self.server_counts and fault == "ok":
            usage = {"prompt_tokens": _prompt_len(req), "completion_tokens": n_out}
            await _send_event(writer, {"choices": [], "usage": usage, "ttft_breakdown": BREAKDOWN})
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    def _token_chunk(self, kind: str, req: dict, i: int, n_out: int) -> dict:
        last = i == n_out - 1
        if kind == "native":
            meta: dict[str, Any] = {"finish_reason": {"type": "length"} if last else None}
            if self.server_counts:
                meta.update(prompt_tokens=_prompt_len(req), completion_tokens=i + 1)
            if last and self.server_counts:
                meta["ttft_breakdown"] = BREAKDOWN
            text = "".join(f" t{j}" for j in range(i + 1))  # cumulative, as are the ids
            return {"text": text, "output_ids": list(range(100, 101 + i)), "meta_info": meta}
        finish = "length" if last else None
        if kind == "openai":
            return {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": finish}]}
        delta = {"content": f" t{i}"}
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _max_tokens(req: dict) -> int:
    if "sampling_params" in req:
        return int(req["sampling_params"]["max_new_tokens"])
    return int(req["max_tokens"])


def _prompt_len(req: dict) -> int:
    if "input_ids" in req:
        return len(req["input_ids"])
    prompt = req.get("text") or req.get("prompt")
    if prompt is None:
        prompt = " ".join(m["content"] for m in req["messages"])
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


async def _sleep_until(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _send_event(writer: asyncio.StreamWriter, obj: dict) -> None:
    writer.write(_chunk(f"data: {json.dumps(obj)}\n\n".encode()))
    await writer.drain()


async def _send_json(writer: asyncio.StreamWriter, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()


if __name__ == "__main__":
    asyncio.run(StreamServer(**json.loads(sys.argv[1])).serve_forever())
