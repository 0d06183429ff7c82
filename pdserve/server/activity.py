"""What a frontend has served lately, for the router's console (GET /stats, docs/console.md).

Plain counters and a short ring of finished requests with their TTFT split into the
four stages the console draws:

    queue         router + frontend + prefill_queue: waiting before the prompt computes
    prefill       the prompt's chunks, to its first token
    transfer      the KV over the wire (and any wait for the decode's reservation)
    first_decode  the decode admitting the request once its KV has landed

A decode's final event carries the prefill's stamps too (edge/stamps.py), so a decode
frontend sees every stage; a stage whose stamps are missing counts as 0.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from pdserve.edge.stamps import ttft_breakdown

RECENT = 16  # finished requests kept (the console shows the last few)
CONSOLE_STAGES = {
    "queue": ("router", "frontend", "prefill_queue"),
    "prefill": ("prefill",),
    "transfer": ("kv_transfer",),
    "first_decode": ("decode_admission",),
}


def console_stages(stages: dict[str, float]) -> dict[str, float]:
    """Seconds per console stage from a request's stamps (edge/stamps.py ttft_breakdown)."""
    b = ttft_breakdown(stages)
    return {k: round(sum(max(b.get(p, 0.0), 0.0) for p in parts), 6)
            for k, parts in CONSOLE_STAGES.items()}  # fmt: skip


class Activity:
    """Counters and the last RECENT finished requests of one frontend."""

    def __init__(self, size: int = RECENT) -> None:
        self.output_tokens = 0  # streamed to clients so far (grows while a request runs)
        self.finished = 0
        # (done_at, prompt tokens, output tokens, finish reason, stamps): the stages are
        # worked out when /stats asks, off the request's path
        self._recent: deque[tuple[float, int, int, str | None, dict[str, float]]]
        self._recent = deque(maxlen=size)

    def tokens(self, k: int) -> None:
        self.output_tokens += k

    def finish(self, prompt_tokens: int, output_tokens: int, reason: str | None,
               stages: dict[str, float]) -> None:  # fmt: skip
        self.finished += 1
        if not stages:  # a request that never reached an engine step has nothing to show
            return
        self._recent.append((time.time(), prompt_tokens, output_tokens, reason, stages))

    def as_dict(self) -> dict[str, Any]:
        recent = [{"done_at": round(at, 3), "prompt_tokens": p, "output_tokens": o,
                   "finish_reason": why, "stages": console_stages(st)}
                  for at, p, o, why, st in self._recent]  # fmt: skip
        return {"output_tokens": self.output_tokens, "finished": self.finished, "recent": recent}
