"""KV transfer throughput: pdserve's ZeroMQ sender/receiver vs raw TCP, on loopback.

The ZeroMQ figure covers the whole path one request takes: gather the prompt's
slots out of the prefill pool, checksum, send, receive, validate, scatter into the
decode pool's (differently numbered) slots, KVDone. The Ready handshake is done
before the clock starts. The raw-TCP baseline, measured in the same run, is one
`sendall` of a buffer of the same size into `recv_into` a preallocated buffer.

    python benchmarks/kv_transfer.py            # table
    python benchmarks/kv_transfer.py --json     # {"results": [...]}
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time

import torch

from pdserve.scheduler.pools import KVLayout
from pdserve.transfer.loopback import Side, make_req, push_prompt, random_pool, reserve, wait_for
from pdserve.transfer.receiver import KVReceiver
from pdserve.transfer.sender import KVSender

BENCH_LAYOUT = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16)


def kv_bytes(layout: KVLayout, tokens: int) -> int:
    return 2 * layout.num_layers * tokens * layout.token_bytes_per_layer


def zmq_once(tx: KVSender, rx: KVReceiver, pre: Side, dec: Side, n: int, room: int) -> float:
    rx.expect(make_req(f"b{room}", room, n, tx.bootstrap_port), dec.pool, dec.slots)
    while room not in tx.active_rooms():  # Ready handshake done before the clock starts
        time.sleep(0.0005)
    t0 = time.perf_counter()
    push_prompt(tx, make_req(f"b{room}", room, n, tx.bootstrap_port), pre, chunk=n)
    [ev] = wait_for(rx.poll, 1, 120)
    dt = time.perf_counter() - t0
    assert ev.ok, ev.reason
    wait_for(tx.poll, 1, 10)
    return dt


def zmq_gbps(n: int, repeats: int) -> float:
    layout = BENCH_LAYOUT
    tx = KVSender("127.0.0.1", 0, layout, heartbeat_s=0.5)
    rx = KVReceiver(layout, kv_timeout_s=120)
    try:
        pre_pool, dec_pool = random_pool(layout, n + 64, 1), random_pool(layout, n + 128, 2)
        pre, dec = (
            Side(pre_pool, *reserve(pre_pool, n, 1)),
            Side(dec_pool, *reserve(dec_pool, n, 2)),
        )
        times = [zmq_once(tx, rx, pre, dec, n, room=1000 + i) for i in range(repeats + 1)][1:]
        assert torch.equal(pre.pool.k[:, pre.slots], dec.pool.k[:, dec.slots])
        return kv_bytes(layout, n) / statistics.median(times) / 1e9
    finally:
        tx.close()
        rx.close()


def raw_tcp_once(nbytes: int) -> float:
    src = bytearray(torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy().tobytes())
    dst = bytearray(nbytes)
    srv = socket.create_server(("127.0.0.1", 0))
    got = threading.Event()

    def receive() -> None:
        conn, _ = srv.accept()
        view, off = memoryview(dst), 0
        while off < nbytes:
            off += conn.recv_into(view[off:])
        conn.close()
        got.set()

    threading.Thread(target=receive, daemon=True).start()
    cli = socket.create_connection(srv.getsockname())
    t0 = time.perf_counter()
    cli.sendall(src)
    got.wait()
    dt = time.perf_counter() - t0
    cli.close()
    srv.close()
    assert dst == src
    return dt


def raw_gbps(nbytes: int, repeats: int) -> float:
    return nbytes / statistics.median(raw_tcp_once(nbytes) for _ in range(repeats)) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    for n in args.tokens:
        nbytes = kv_bytes(BENCH_LAYOUT, n)
        z, r = zmq_gbps(n, args.repeats), raw_gbps(nbytes, args.repeats)
        results.append(
            {
                "tokens": n,
                "bytes": nbytes,
                "zmq_gbps": round(z, 3),
                "raw_tcp_gbps": round(r, 3),
                "ratio": round(z / r, 3),
            }
        )
    if args.json:
        print(json.dumps({"results": results}))
        return
    print(f"layout {BENCH_LAYOUT.fingerprint()}, TCP loopback, median of {args.repeats}")
    print(f"{'tokens':>7} {'MiB':>8} {'zmq GB/s':>9} {'raw GB/s':>9} {'ratio':>6}")
    for x in results:
        print(
            f"{x['tokens']:>7} {x['bytes'] / 2**20:>8.1f} {x['zmq_gbps']:>9.2f} {x['raw_tcp_gbps']:>9.2f} {x['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
