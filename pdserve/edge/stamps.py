"""Time stamps a request collects before an engine sees it (the TTFT breakdown's
first stages, server/generation.py ttft_breakdown):

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
