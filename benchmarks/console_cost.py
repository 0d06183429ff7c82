"""What the web console costs: the page's size, and the bytes of one /console/state poll
idle and after a small load (its `recent` list full), on `pdserve up` (tiny model unless
--model). The requests it adds follow from router/console.py: one /console/state a
second per open Live view, and per worker at most one GET /stats per CACHE_S however
many views are open (tests/test_console.py checks the sharing).

    python benchmarks/console_cost.py [--model tiny]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from up_stack import pdserve_up

from pdserve.router.console import CACHE_S
from pdserve.router.webui import FILES, load_files


def page_sizes() -> None:
    files = load_files()
    total = sum(len(b) for b, _ in files.values())
    zipped = sum(len(gzip.compress(b)) for b, _ in files.values())
    for path in FILES:
        print(f"  {path:24s} {len(files[path][0]):6d} B")
    print(f"page total: {total} B ({zipped} B if gzipped; served uncompressed)")


def poll_bytes(url: str, n: int = 8) -> tuple[float, int]:
    sizes = []
    for _ in range(n):
        sizes.append(len(httpx.get(url + "/console/state", timeout=10).content))
        time.sleep(CACHE_S + 0.05)  # past the router's cached answer
    body = httpx.get(url + "/console/state", timeout=10).json()
    return statistics.mean(sizes), len(body["recent"])


def load(url: str, requests: int = 16) -> None:
    body = {"prompt": "console cost " * 8, "max_tokens": 16, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60),
                      range(requests)))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    page_sizes()
    with pdserve_up("console-cost", args.model) as url:
        idle, _ = poll_bytes(url)
        load(url)
        busy, recent = poll_bytes(url)
        example = httpx.get(url + "/console/state", timeout=10).json()
    print(f"/console/state, 1 prefill + 1 decode: {idle:.0f} B idle, {busy:.0f} B with "
          f"{recent} recent requests")  # fmt: skip
    print(json.dumps(example["workers"][1], indent=1)[:600])


if __name__ == "__main__":
    main()
