"""KV transfer throughput: pdserve's ZeroMQ sender/receiver vs raw TCP, on loopback.

Two processes, as deployed: the prefill side (KVSender) runs in a child process,
the decode side (KVReceiver) here. The ZeroMQ figure covers the whole path of one
request, from the decode's expect() to its SourceEvent: Ready, gather of the
prompt's (shuffled) pages out of the prefill pool, checksums, send, receive,
validation, scatter into the decode pool's (differently numbered) pages, KVDone.
The received bytes are checked against the prefill's afterwards. The raw-TCP
baseline, measured in the same run, is a child process's `sendall` of a buffer of
the same size into `recv_into` a preallocated buffer, timed from a 1-byte 'go'.

    python benchmarks/kv_transfer.py            # table
    python benchmarks/kv_transfer.py --json     # {"results": [...]}
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time

import torch

from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.loopback import Side, make_req, push_prompt, random_pool, reserve, wait_for
from pdserve.transfer.receiver import KVReceiver
from pdserve.transfer.sender import MAX_FRAME_BYTES, KVSender

BENCH_LAYOUT = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16)


def kv_bytes(layout: KVLayout, tokens: int) -> int:
    return 2 * layout.num_layers * tokens * layout.token_bytes_per_layer


def prefill_side(n: int, rooms: list[int], port_q: mp.Queue, frame_bytes: int) -> None:
    """Child process: the prefill. Admits and computes every room at once; each one's
    KV leaves as soon as the decode's Ready arrives (so the decode's clock, started
    at expect(), covers Ready + gather + send + receive + scatter + KVDone)."""
    tx = KVSender(
        "127.0.0.1",
        0,
        BENCH_LAYOUT,
        heartbeat_s=0.5,
        ack_timeout_s=300,
        max_frame_bytes=frame_bytes,
    )
    pool = random_pool(BENCH_LAYOUT, n + 64, 1)
    side = Side(pool, *reserve(pool, n, 1))
    for room in rooms:
        push_prompt(tx, make_req(f"b{room}", room, n, tx.bootstrap_port), side, chunk=n)
    port_q.put(tx.bootstrap_port)
    events = wait_for(tx.poll, len(rooms), 600)
    port_q.put(sum(e.ok for e in events))
    tx.close()


def zmq_gbps(n: int, repeats: int, frame_bytes: int = MAX_FRAME_BYTES) -> float:
    rooms = list(range(1000, 1001 + repeats))  # the first one warms up
    port_q: mp.Queue = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(
        target=prefill_side, args=(n, rooms, port_q, frame_bytes)
    )
    child.start()
    rx = KVReceiver(BENCH_LAYOUT, kv_timeout_s=300)
    try:
        port = port_q.get(timeout=120)
        dec_pool = random_pool(BENCH_LAYOUT, n + 128, 2)
        dec = Side(dec_pool, *reserve(dec_pool, n, 2))
        times = []
        for room in rooms:
            t0 = time.perf_counter()
            rx.expect(make_req(f"b{room}", room, n, port), dec.pool, dec.slots)
            [ev] = wait_for(rx.poll, 1, 300)
            times.append(time.perf_counter() - t0)
            assert ev.ok, ev.reason
        assert port_q.get(timeout=60) == len(rooms)
        pre_pool = random_pool(BENCH_LAYOUT, n + 64, 1)  # the child's pool, regenerated
        _, pre_slots = reserve(pre_pool, n, 1)
        assert torch.equal(pre_pool.k[:, pre_slots], dec.pool.k[:, dec.slots])
        assert torch.equal(pre_pool.v[:, pre_slots], dec.pool.v[:, dec.slots])
        return kv_bytes(BENCH_LAYOUT, n) / statistics.median(times[1:]) / 1e9
    finally:
        rx.close()
        child.join(timeout=30)


def raw_sender(port: int, nbytes: int, repeats: int) -> None:
    """Child process: sendall a buffer, once per 'go' byte from the receiver."""
    src = bytes(torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy())
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(repeats):
            s.recv(1)
            s.sendall(src)


def raw_gbps(nbytes: int, repeats: int) -> float:
    srv = socket.create_server(("127.0.0.1", 0))
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=raw_sender, args=(srv.getsockname()[1], nbytes, repeats + 1))
    child.start()
    conn, _ = srv.accept()
    dst = bytearray(nbytes)
    view, times = memoryview(dst), []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        conn.send(b"g")
        off = 0
        while off < nbytes:
            off += conn.recv_into(view[off:])
        times.append(time.perf_counter() - t0)
    conn.close()
    srv.close()
    child.join(timeout=30)
    return nbytes / statistics.median(times[1:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--frame-mib", type=float, default=MAX_FRAME_BYTES / 2**20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    for n in args.tokens:
        nbytes = kv_bytes(BENCH_LAYOUT, n)
        z, r = (
            zmq_gbps(n, args.repeats, int(args.frame_mib * 2**20)),
            raw_gbps(nbytes, args.repeats),
        )
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
    print(
        f"layout {BENCH_LAYOUT.fingerprint()}, TCP loopback, 2 processes, median of {args.repeats}"
    )
    print(f"{'tokens':>7} {'MiB':>8} {'zmq GB/s':>9} {'raw GB/s':>9} {'ratio':>6}")
    for x in results:
        print(
            f"{x['tokens']:>7} {x['bytes'] / 2**20:>8.1f} {x['zmq_gbps']:>9.2f} {x['raw_tcp_gbps']:>9.2f} {x['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
