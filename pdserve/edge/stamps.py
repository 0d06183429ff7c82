"""Time stamps a request collects before an engine sees it (the TTFT breakdown's
first stages, ttft_breakdown below):

    client ─▶ router ──────────────────▶ frontend ──────────────────▶ engine
              router_at: its handler      http_at: its handler         arrive: handed
              starts (ROUTER_AT header,   starts                       over (received_at)
              sent to both legs)

`router`: router_at -> the prefill frontend's http_at (the router's forwarding and the
hop); `frontend`: http_at -> the handoff (parsing, validation, tokenization). Seconds of
time.time(): one clock per host; across hosts a span carries the clocks' skew. A router
of another make (sglang-router) sends no header: the breakdown then has no `router`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

ROUTER_AT = "x-pdserve-router-at"


def router_header(now: float | None = None) -> dict[str, str]:
    """The header the router adds to both legs of a request (its handler started `now`)."""
    return {ROUTER_AT: f"{time.time() if now is None else now:.6f}"}


def arrival_stamps(headers: Mapping[str, str], now: float | None = None) -> dict[str, float]:
    """A frontend's stamps of a request whose handler started `now`: http_at, and the
    router's router_at when its header holds a finite positive number (else dropped:
    a stamp never fails a request)."""
    out = {"http_at": time.time() if now is None else now}
    raw = headers.get(ROUTER_AT)
    try:
        at = float(raw) if raw is not None else math.nan
    except ValueError:
        at = math.nan
    if math.isfinite(at) and at > 0:
        out["router_at"] = at
    return out


def ttft_breakdown(stages: dict[str, float]) -> dict[str, float]:
    """Seconds per TTFT stage from the router's, frontends' and engines' time.time()
    stamps; a stage whose stamps are missing is left out. The router sends a request to
    both legs at once:

        router:  router_at ─router─▶ prefill_http ─frontend─▶ prefill_arrive   (prefill leg)
        decode:  arrive ─queue─▶ reserved ·······································▶ kv_done
        prefill: prefill_arrive ─prefill_queue─▶ prefill_start ─prefill─▶ prefill_end ─┘
                                                                   kv_transfer ──────┘
        decode:  kv_done ─decode_admission─▶ running (the first token is emitted)

    `router` and `frontend` (arrival_stamps) follow the prefill leg, the one the first
    token waits on; without the prefill's stamps, the decode's own (http_at, arrive).

    `arrive` / `prefill_arrive`: each leg's frontend hands the request to its engine
    (EngineRequest.received_at). `queue`: until the decode has reserved a row and KV
    pages (the engine reads new requests between steps); `prefill_queue`: until the
    prompt starts computing (the prefill step in progress, a row, pages, its turn in
    the chunk budget); `prefill`: from its first chunk to its first token (chunks of
    other prompts share those steps); `kv_transfer`: the rest of the KV goes over the
    wire (and any wait for the decode's reservation). The prefill's stamps come with its KV
    (transfer/base.py PREFILL_STAGES); on different hosts they carry the clocks' skew.
    Without them `kv_transfer` is the whole wait from reserved to kv_done. The decode
    emits the first token as soon as the KV has landed, so `decode_admission` is
    near zero.
    """
    out: dict[str, float] = {}

    def span(name: str, a: str, b: str) -> None:
        if a in stages and b in stages:
            out[name] = stages[b] - stages[a]

    via_prefill = "prefill_http" in stages
    http, handoff = ("prefill_http", "prefill_arrive") if via_prefill else ("http_at", "arrive")
    span("router", "router_at", http)
    span("frontend", http, handoff)
    span("queue", "arrive", "reserved")
    span("prefill_queue", "prefill_arrive", "prefill_start")
    if "prefill_start" in stages and "prefill_end" in stages:
        span("prefill", "prefill_start", "prefill_end")
        span("kv_transfer", "prefill_end", "kv_done")
    else:
        span("kv_transfer", "reserved", "kv_done")
    span("decode_admission", "kv_done", "running")
    return out
