"""What the router's migration-aware relay costs per streamed event.

The router relays a decode's stream block by block (router/relay.py: each event's
`: ids` comment parsed and stripped, the ids recorded, error events and [DONE] watched),
where a plain relay would pass the bytes through. This streams `--events` events from a
fake decode (tests/fake_workers.py, no model, no delay) through one router, in turns:

    relay        the router as it is (the decode sends the ids comments it is asked for)
    passthrough  the same router with its relay swapped for a byte passthrough, and no
                 ids asked for (the decode's chunks as they come: what the router did
                 before migration)

and prints the seconds per stream of each and their ratio (median of `--rounds`).

    python benchmarks/router_relay.py [--events 2000] [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_workers import FakeWorker, Served  # noqa: E402

from pdserve.router import proxy  # noqa: E402
from pdserve.router.app import RouterConfig, create_app  # noqa: E402
from pdserve.router.legs import chunks  # noqa: E402

RELAY, HEADER = proxy.events, proxy.TOKEN_IDS_HEADER


async def passthrough(run: Any, a: Any) -> AsyncIterator[bytes]:
    async for chunk in chunks(a.decode_resp, a.tasks[0]):
        yield chunk
    run.done = True


def one_stream(url: str, events: int) -> float:
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": events}}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        n = sum(1 for line in r.iter_lines() if line.startswith("data: {"))
    assert n == events, n
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    p = FakeWorker("prefill", "P").start()
    d = FakeWorker("decode", "D", stream_chunks=args.events).start()
    router = Served(create_app(RouterConfig(prefill=((p.url, 9001),), decode=(d.url,))))
    times: dict[str, list[float]] = {"relay": [], "passthrough": []}
    try:
        one_stream(router.url, args.events)  # warm up
        for _ in range(args.rounds):
            for name, relay, header in (("relay", RELAY, HEADER),
                                        ("passthrough", passthrough, "x-unused")):  # fmt: skip
                proxy.events, proxy.TOKEN_IDS_HEADER = relay, header  # type: ignore[assignment]
                times[name].append(one_stream(router.url, args.events))
    finally:
        proxy.events, proxy.TOKEN_IDS_HEADER = RELAY, HEADER  # type: ignore[assignment]
        router.stop()
        p.stop()
        d.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"events": args.events, "rounds": args.rounds, "seconds": med,
           "relay_over_passthrough": med["relay"] / med["passthrough"]}  # fmt: skip
    if args.json:
        print(json.dumps(out))
        return
    for k, v in med.items():
        print(f"{k:12s} {v:.3f} s per stream of {args.events} events "
              f"({v / args.events * 1e6:.0f} us/event)")  # fmt: skip
    print(f"relay / passthrough: {out['relay_over_passthrough']:.2f}")


if __name__ == "__main__":
    main()
