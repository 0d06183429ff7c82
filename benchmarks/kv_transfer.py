"""KV transfer throughput: pdserve's ZeroMQ sender/receiver vs raw TCP, on loopback.

Two processes, as deployed: the prefill side (KVSender) runs in a child process,
the decode side (KVReceiver) here. The ZeroMQ figure covers the whole path of one
request, from the decode's expect() to its SourceEvent: Ready, the prompt's pages read
out of the prefill pool, checksums, send, receive, validation, scatter into the decode
pool's (shuffled, differently numbered) pages, KVDone. --ready: whether the prefill
has computed the prompt when the decode's Ready comes (late, the default: the sender
hashed the pieces sent in place before it came, transfer/sending/pieces.py) or computes it after
(first: every hash on the path). The prefill's pages
(--prefill-pages): `runs` as its allocator hands them out of a fresh pool (consecutive
pages, sent in place: no gather, transfer/sending/pieces.py), or `shuffled` (a fragmented pool:
every page gathered into a staging frame).
The received bytes are checked against the prefill's afterwards.

Raw TCP takes turns with the transfers it is compared with, in the same two processes
(RawTCP): before each of them, a thread of the child (`raw_peer`) `sendall`s a buffer
of the same size into `recv_into` a preallocated buffer, timed from a 1-byte 'go'.
Every transfer, raw or not, starts QUIET_S after the one before, so what that one left
running (the prefill's Ack and report) is done. Taking turns, both see the same CPUs,
caches and moment: in a process pair of its own raw loopback TCP swings 2x on a
small VM with where its two processes land, and each ratio would with it. A run's
ratio is the median GB/s of its transfers over that of its raw ones (the first of each
warms up); their CPU is taken out of the processes' and the threads' CPU.
The ZeroMQ floor is ZeroMQ alone moving the same messages (a K and a V message per
piece, a zero-copy frame per layer) between two processes, timed from a 'go' message,
raw TCP taking turns with it too: how far raw TCP is out of reach of any ZeroMQ path
here, and how much of that floor pdserve's whole path keeps ('of floor': pdserve's
ratio over the floor's, each to its own run's raw TCP). The floor
'+checks' adds what the decode must do with each message whichever way it is written
(hash each block of its frames, compare it and write it into the pool's shuffled pages:
the native scatter on the kernel threads, as the receiver; no header checks, coverage
map, Ready or KVDone): the part of the gap to raw TCP that is the design's (every byte
hashed before it is written into the pool), not pdserve's handshakes or Python.
The same transfer runs again with CURVE on (encryption + authentication).

Stage shares (pdserve/transfer/stages.py): seconds each side spent in a stage,
divided by the wall time of all its transfers. Sender: gather, checksum, send (incl.
waiting for a free staging buffer; a piece gathered by the native kernel is hashed
inside its gather); receiver: receive, verify, scatter. The sides
run concurrently, so shares of different stages overlap; the rest is idle time.
CPU ratio: raw TCP's CPU time per byte (the two threads at its ends) over ZeroMQ's
(both processes, all threads, user + system); on a machine shared with other work it
varies less than the wall time.
tx / rx ns/B: ZeroMQ's CPU per byte in the sender and in the receiver process.
CPU by thread: each process's CPU milliseconds per timed transfer by kind of thread (main,
the transfer's I/O thread, libzmq's I/O threads, pyzmq's zero-copy collector, other:
par.c's kernel workers and the rest), from /proc (Linux), so the thread that costs is
visible; the decode's main also pays for reading /proc once per run (about 0.5 ms).

    python benchmarks/kv_transfer.py            # table
    python benchmarks/kv_transfer.py --json     # {"results": [...]}
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import resource
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq
import zmq.utils.garbage
from proc_cpu import cpu_by_kind, thread_times

from pdserve.envs import cache_root
from pdserve.kernels.native.page_copy import PageCopy, page_copy
from pdserve.kvcache.pools import KVLayout
from pdserve.transfer import stages
from pdserve.transfer.checksum import HASH_BLOCK, block_hashes
from pdserve.transfer.heap import keep_freed_memory
from pdserve.transfer.loopback import (
    Side,
    make_req,
    push_prompt,
    random_pool,
    reserve,
    transfer_settings,
    wait_for,
)
from pdserve.transfer.pages import pool_views, request_pages
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.push import Pusher
from pdserve.transfer.sending.sender import MAX_FRAME_BYTES, KVSender
from pdserve.transfer.zmq_io import CurveKeys, make_socket

STAGES = ("gather", "checksum", "send", "receive", "verify", "scatter")

POLL_S = 0.0002  # --ready first: how often the prefill looks for the decode's Ready
# NOTE: before each transfer, raw or not: what the previous one left running (the
# prefill's Ack and report, libzmq letting frames go) is done, on either side of a turn
QUIET_S = 0.003

BENCH_LAYOUT = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16)


def thread_kinds() -> dict[int, str]:
    """This process's Python threads that a transfer uses, by thread id -> kind."""
    kinds = {"MainThread": "main", "kv-sender": "transfer I/O", "kv-receiver": "transfer I/O"}
    out = {t.native_id: kinds[t.name] for t in threading.enumerate() if t.name in kinds}
    collector = zmq.utils.garbage.gc.thread
    if collector is not None and collector.native_id is not None:
        out[collector.native_id] = "pyzmq collector"
    return {k: v for k, v in out.items() if k is not None}


def kv_bytes(layout: KVLayout, tokens: int) -> int:
    return 2 * layout.num_layers * tokens * layout.token_bytes_per_layer


def cpu_s() -> float:
    """CPU seconds (user + system, all threads) this process has used so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def prefill_side(
    n: int,
    rooms: list[int],
    port_q: mp.Queue,
    frame_bytes: int,
    curve: CurveKeys | None,
    device: str,
    pages: str,
    ready: str,
    raw_port: int,
) -> None:
    """Child process: the prefill (and raw TCP's sending end, raw_peer). `ready` late:
    admits and computes every room at once, and each one's KV leaves as soon as the
    decode's Ready arrives (so the decode's clock, started at expect(), covers Ready +
    gather + send + receive + scatter + KVDone; the sender hashes in-place pieces before
    the Ready, transfer/sending/pieces.py). `first`: computes a room only once its Ready has arrived (polled
    every POLL_S), so every hash is on the path."""
    keep_freed_memory()  # as the engine process does, before its sockets exist
    raw = raw_peer(raw_port, kv_bytes(BENCH_LAYOUT, n))
    tx = KVSender(
        BENCH_LAYOUT,
        transfer_settings(heartbeat_interval_s=0.5, kv_timeout_s=300),
        max_frame_bytes=frame_bytes,
        curve=curve,
    )
    pool = random_pool(BENCH_LAYOUT, n + 64, 1, device)
    side = Side(pool, *reserve(pool, n, 1, shuffle=pages == "shuffled"))
    reqs = [make_req(f"b{room}", room, n, tx.bootstrap_port) for room in rooms]
    if ready == "late":
        for req in reqs:
            push_prompt(tx, req, side, chunk=n)
    gc.freeze()  # as the engine process does once it is built
    c0 = cpu_s()
    port_q.put(tx.bootstrap_port)
    if ready == "first":  # the decode asks for one room at a time, in order
        for req in reqs:
            while req.room not in tx.active_rooms():
                time.sleep(POLL_S)
            push_prompt(tx, req, side, chunk=n)
    events = wait_for(tx.poll, len(rooms), 600)
    raw.join(timeout=60)  # NOTE: ended (its CPU in no thread's below), the decode's loop done
    threads = (thread_times(), thread_kinds())  # NOTE: here, before its threads end
    port_q.put((sum(e.ok for e in events), stages.snapshot(), cpu_s() - c0, threads))
    tx.close()


@dataclass
class Run:
    """One run of a path with raw TCP taking turns with it (RawTCP), in one process pair."""

    gbps: float  # median over the timed transfers (the first one warms up)
    raw_gbps: float  # raw TCP's, the same way
    cpu_ns: tuple[float, float]  # CPU ns per byte of the (sender, receiver) process
    raw_cpu_ns: float  # raw TCP's CPU ns per byte, both ends
    shares: dict[str, float] = field(default_factory=dict)  # stage -> share of the wall time
    threads: dict[str, dict[str, float]] = field(default_factory=dict)  # side -> kind -> ms

    @property
    def ratio(self) -> float:
        return self.gbps / self.raw_gbps


def zmq_run(
    n: int,
    repeats: int,
    frame_bytes: int = MAX_FRAME_BYTES,
    curve: CurveKeys | None = None,
    device: str = "cpu",
    pages: str = "runs",
    ready: str = "late",
) -> Run:
    """pdserve's path, raw TCP before each transfer. Run.threads: {"prefill", "decode"}
    -> CPU ms per transfer by kind of thread (raw TCP's taken out)."""
    rooms = list(range(1000, 1001 + repeats))  # the first one warms up
    raw = RawTCP(kv_bytes(BENCH_LAYOUT, n))
    port_q: mp.Queue = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(
        target=prefill_side,
        args=(n, rooms, port_q, frame_bytes, curve, device, pages, ready, raw.port),
    )
    child.start()
    # keep_freed_memory: main()
    rx = KVReceiver(BENCH_LAYOUT, transfer_settings(kv_timeout_s=300), curve=curve)
    stages.reset()
    try:
        raw.accept()
        port = port_q.get(timeout=120)
        dec_pool = random_pool(BENCH_LAYOUT, n + 128, 2, device)
        dec = Side(dec_pool, *reserve(dec_pool, n, 2))
        gc.freeze()  # as the engine process does once it is built
        times, c0, snaps = [], cpu_s(), [{}, {}]
        for room in rooms:
            raw.transfer()
            time.sleep(QUIET_S)
            t0 = time.perf_counter()
            rx.expect(make_req(f"b{room}", room, n, port), dec.pool, dec.slots)
            [ev] = rx.wait(300)  # blocking, as raw TCP's recv_into (no poll interval)
            times.append(time.perf_counter() - t0)
            assert ev.ok, ev.reason
            if room == rooms[0]:  # the timed transfers start after the warm-up
                prefill_start = thread_times(child.pid)  # NOTE: first: reading it costs
                snaps = [thread_times(), prefill_start]
                raw_main = raw.cpu
        cpu, decode_end = cpu_s() - c0 - raw.cpu, thread_times()
        peer_cpu = raw.close()
        ok, sender_stages, sender_cpu, (prefill_end, sender_kinds) = port_q.get(timeout=60)
        per = 1e3 / repeats  # CPU ms per timed transfer
        threads = {
            side: {k: round(v * per, 3) for k, v in cpu_by_kind(a, b, kinds).items()}
            for side, a, b, kinds in (
                ("decode", snaps[0], decode_end, thread_kinds()),
                ("prefill", snaps[1], prefill_end, sender_kinds),
            )
        }
        main = threads["decode"]["main"] - (raw.cpu - raw_main) * per  # less raw TCP's recv
        threads["decode"]["main"] = round(main, 3)
        assert ok == len(rooms)
        nbytes = kv_bytes(BENCH_LAYOUT, n)
        moved = nbytes * len(rooms)
        cpu_ns = ((sender_cpu - peer_cpu) / moved * 1e9, cpu / moved * 1e9)
        seconds = {**sender_stages, **stages.snapshot()}
        shares = {k: round(seconds.get(k, 0.0) / sum(times), 3) for k in STAGES}
        pre_pool = random_pool(BENCH_LAYOUT, n + 64, 1)  # the child's pool, regenerated
        _, pre_slots = reserve(pre_pool, n, 1, shuffle=pages == "shuffled")
        dec_slots = dec.slots.to(device)
        assert torch.equal(pre_pool.k[:, pre_slots], dec.pool.k[:, dec_slots].cpu())
        assert torch.equal(pre_pool.v[:, pre_slots], dec.pool.v[:, dec_slots].cpu())
        gbps = nbytes / statistics.median(times[1:]) / 1e9
        raw_ns = (raw.cpu + peer_cpu) / moved * 1e9
        return Run(gbps, raw.gbps(), cpu_ns, raw_ns, shares, threads)
    finally:
        rx.close()
        raw.shut()
        child.join(timeout=30)


def raw_peer(port: int, nbytes: int) -> threading.Thread:
    """A child's end of RawTCP: a thread ("raw-tcp") that sendall()s `nbytes` once per
    'g' byte; at 'x' it sends back its CPU seconds in them and ends. The bytes are made
    here, before the thread starts: the child's CPU count starts after this returns."""
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes()

    def serve() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            cpu = 0.0
            while s.recv(1) == b"g":
                c0 = time.thread_time()
                s.sendall(src)
                cpu += time.thread_time() - c0
            s.sendall(f"{cpu!r}\n".encode())

    thread = threading.Thread(target=serve, name="raw-tcp", daemon=True)
    thread.start()
    return thread


class RawTCP:
    """The decode's end of raw TCP taking turns with the transfers measured, in the same
    two processes (the module docstring): `transfer` sends a 'go' byte to the child's
    raw_peer and recv_into()s its `nbytes` into a buffer made once."""

    def __init__(self, nbytes: int) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(120)
        self.port = self.srv.getsockname()[1]
        self.view = memoryview(bytearray(nbytes))
        self.times: list[float] = []
        self.cpu = 0.0  # this (the main) thread's CPU seconds in the transfers
        self.conn: socket.socket | None = None

    def accept(self) -> None:
        self.conn, _ = self.srv.accept()
        self.conn.settimeout(120)

    def transfer(self) -> None:
        assert self.conn is not None
        time.sleep(QUIET_S)
        c0, t0 = time.thread_time(), time.perf_counter()
        self.conn.send(b"g")
        off, nbytes = 0, self.view.nbytes
        while off < nbytes:
            got = self.conn.recv_into(self.view[off:])
            if not got:
                raise ConnectionError("raw TCP: the child closed")
            off += got
        self.times.append(time.perf_counter() - t0)
        self.cpu += time.thread_time() - c0

    def gbps(self) -> float:
        """Median over the transfers after the first (a warm-up, as the others')."""
        return self.view.nbytes / statistics.median(self.times[1:]) / 1e9

    def close(self) -> float:
        """End the child's raw_peer; returns its CPU seconds in the transfers."""
        assert self.conn is not None
        self.conn.send(b"x")
        with self.conn.makefile("rb") as f:
            return float(f.readline())

    def shut(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.srv.close()


def floor_pieces(n: int, frame_bytes: int) -> list[tuple[int, int]]:
    """[tok_start, tok_end) of each piece, as the sender splits a prompt of n tokens."""
    per = Pusher(BENCH_LAYOUT, frame_bytes).max_tokens
    return [(t, min(n, t + per)) for t in range(0, n, per)]


def floor_rows(n: int) -> np.ndarray:
    """The bytes floor_sender sends: [kind, layer, token, row bytes]."""
    lay = BENCH_LAYOUT
    shape = (2, lay.num_layers, n, lay.token_bytes_per_layer)
    return np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8)


def floor_sender(port: int, n: int, repeats: int, frame_bytes: int, raw_port: int) -> None:
    """Child process: ZeroMQ alone (and raw TCP's sending end, raw_peer). Once per 'go'
    message, the bytes of an n-token transfer as pdserve sends them in place (a K then a
    V message per piece, a small header and one zero-copy, tracked frame per layer), and
    nothing else: no Ready handling, no checksum, no KVDone."""
    raw_peer(raw_port, kv_bytes(BENCH_LAYOUT, n))
    rows = floor_rows(n)
    sock = make_socket(zmq.PAIR)
    sock.connect(f"tcp://127.0.0.1:{port}")
    header = bytes(160)  # about a msgspec KVChunk's size
    c0 = cpu_s()
    for _ in range(repeats):
        sock.recv()
        for t0, t1 in floor_pieces(n, frame_bytes):
            for kind in range(2):
                frames = [zmq.Frame(rows[kind, layer, t0:t1], copy=False, track=True)
                          for layer in range(BENCH_LAYOUT.num_layers)]  # fmt: skip
                sock.send_multipart([header, *frames], copy=False)
    sock.recv()  # the receiver is done
    sock.send(str(cpu_s() - c0).encode())  # CPU seconds of its threads (raw TCP's too)
    sock.close(linger=1000)


class Checks:
    """What the decode must do with each received message as it writes it, with as
    little Python as it takes: each block of its frames hashed, compared and written into
    a pool's (shuffled) pages by the native scatter on the kernel threads, as the
    receiver does. No header checks, coverage map, Ready or KVDone. The hashes it
    compares with are the sender's bytes' (floor_rows), taken once per size: every
    block must match, or the run stops."""

    def __init__(self, copy: PageCopy, n: int, frame_bytes: int) -> None:
        pool = random_pool(BENCH_LAYOUT, n + 128, 2)
        _, slots = reserve(pool, n, 2)
        self.pages = request_pages(slots.numpy(), BENCH_LAYOUT.page_size)
        k, v = pool_views(pool)
        assert k is not None and v is not None
        self.writer = copy.writer((k, v), BENCH_LAYOUT.page_size)  # as the receiver's, once
        rows = floor_rows(n)
        self.want = {
            (kind, t0): block_hashes(list(rows[kind, :, t0:t1]))
            for t0, t1 in floor_pieces(n, frame_bytes)
            for kind in range(2)
        }

    @classmethod
    def make(cls, n: int, frame_bytes: int) -> Checks | None:
        """None without the native kernels (no C compiler): no +checks floor then."""
        copy = page_copy(cache_root(), split=True)
        return None if copy is None or not copy.verifies else cls(copy, n, frame_bytes)

    def __call__(self, kind: int, t0: int, frames: list[zmq.Frame]) -> None:
        assert self.pages is not None and self.writer is not None
        bufs = [f.buffer for f in frames]
        rows = bufs[0].nbytes // BENCH_LAYOUT.token_bytes_per_layer
        layers = (0, BENCH_LAYOUT.num_layers)
        want = self.want[kind, t0]
        if not self.writer.scatter(kind, layers, self.pages, t0, [rows], bufs, want, HASH_BLOCK):
            raise RuntimeError(f"+checks: a block of kind {kind} at token {t0} failed its hash")


def floor_run(n: int, repeats: int, frame_bytes: int, checks: Checks | None = None) -> Run:
    """ZeroMQ alone (floor_sender), timed as zmq_run, from the 'go' to the last message
    received, raw TCP before each transfer. `checks`: with the decode's hash and page
    write of each message."""
    sock = make_socket(zmq.PAIR)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    nbytes = kv_bytes(BENCH_LAYOUT, n)
    raw = RawTCP(nbytes)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=floor_sender, args=(port, n, repeats + 1, frame_bytes, raw.port))
    child.start()
    pieces, times, c0 = floor_pieces(n, frame_bytes), [], cpu_s()
    try:
        raw.accept()
        for _ in range(repeats + 1):
            raw.transfer()
            time.sleep(QUIET_S)
            t0 = time.perf_counter()
            sock.send(b"g")
            for tok, _ in pieces:
                for kind in range(2):
                    parts = sock.recv_multipart(copy=False)
                    if checks is not None:
                        checks(kind, tok, parts[1:])
            times.append(time.perf_counter() - t0)
        cpu = cpu_s() - c0 - raw.cpu
        peer_cpu = raw.close()
        sock.send(b"end")
        sender_cpu = float(sock.recv()) - peer_cpu
    finally:
        child.join(timeout=30)
        sock.close()
        raw.shut()
    moved = nbytes * (repeats + 1)
    gbps = nbytes / statistics.median(times[1:]) / 1e9
    cpu_ns = (sender_cpu / moved * 1e9, cpu / moved * 1e9)
    return Run(gbps, raw.gbps(), cpu_ns, (raw.cpu + peer_cpu) / moved * 1e9)


def measure(n: int, args: argparse.Namespace) -> dict:
    """Rounds of (pdserve, ZeroMQ alone, + checks) back to back, each with raw TCP taking
    turns with it (RawTCP); each ratio is the median of the rounds' ratios."""
    frame = int(args.frame_mib * 2**20)
    rounds = []
    checks = Checks.make(n, frame)  # its pool made once for the rounds
    for _ in range(args.rounds):
        z = zmq_run(
            n, args.repeats, frame, device=args.device, pages=args.prefill_pages, ready=args.ready
        )
        f = floor_run(n, args.repeats, frame)
        checked = floor_run(n, args.repeats, frame, checks) if checks else None
        rounds.append((z, f, checked))
    med = statistics.median
    zs = [x[0] for x in rounds]
    z_cpu, r_cpu = med(sum(z.cpu_ns) for z in zs), med(z.raw_cpu_ns for z in zs)
    out = {
        "tokens": n,
        "prefill_pages": args.prefill_pages,
        "ready": args.ready,
        "bytes": kv_bytes(BENCH_LAYOUT, n),
        "zmq_gbps": round(med(z.gbps for z in zs), 3),
        "raw_tcp_gbps": round(med(z.raw_gbps for z in zs), 3),
        "ratio": round(med(z.ratio for z in zs), 3),
        "round_ratios": [round(z.ratio, 3) for z in zs],
        "zmq_floor_gbps": round(med(f.gbps for _, f, _ in rounds), 3),
        "floor_ratio": round(med(f.ratio for _, f, _ in rounds), 3),
        "of_floor": round(med(z.ratio / f.ratio for z, f, _ in rounds), 3),
        "floor_cpu_ns_per_byte": round(med(sum(f.cpu_ns) for _, f, _ in rounds), 3),
        "zmq_cpu_ns_per_byte": round(z_cpu, 3),
        "zmq_sender_cpu_ns_per_byte": round(med(z.cpu_ns[0] for z in zs), 3),
        "zmq_receiver_cpu_ns_per_byte": round(med(z.cpu_ns[1] for z in zs), 3),
        "raw_cpu_ns_per_byte": round(r_cpu, 3),
        "cpu_ratio": round(r_cpu / z_cpu, 3),
        "shares": zs[-1].shares,
        "thread_cpu_ms": zs[-1].threads,
    }
    if checks is not None:  # then every round has its +checks run
        checked = [(z, c) for z, _, c in rounds if c is not None]
        out["checked_floor_gbps"] = round(med(c.gbps for _, c in checked), 3)
        out["checked_floor_ratio"] = round(med(c.ratio for _, c in checked), 3)
        out["of_checked_floor"] = round(med(z.ratio / c.ratio for z, c in checked), 3)
    if not args.no_curve:
        keys = CurveKeys.generate()
        c = zmq_run(n, args.repeats, frame, keys, args.device, args.prefill_pages, args.ready)
        out.update(
            curve_gbps=round(c.gbps, 3), curve_ratio=round(c.ratio, 3), curve_shares=c.shares
        )
    return out


def print_table(results: list[dict], repeats: int, pages: str, ready: str) -> None:
    print(
        f"layout {BENCH_LAYOUT.fingerprint()}, TCP loopback, 2 processes, prefill pages {pages},"
        f" Ready {ready},"
        f" median of {repeats} transfers per run, raw TCP taking turns with them in each run;"
        " ratio: median over the rounds"
    )
    print(
        f"{'tokens':>7} {'MiB':>7} {'zmq GB/s':>9} {'raw GB/s':>9} {'ratio':>6}"
        f" {'floor GB/s':>10} {'ratio':>6} {'of floor':>8} {'+checks GB/s':>12} {'ratio':>6}"
        f" {'of it':>6} {'CURVE GB/s':>10} {'ratio':>6} {'CPU ratio':>9} {'tx ns/B':>7} {'rx ns/B':>7} {'raw ns/B':>8} {'floor ns/B':>10}  "
        + " ".join(f"{s:>8}" for s in STAGES)
    )
    for x in results:
        curve = (
            f"{x['curve_gbps']:>10.2f} {x['curve_ratio']:>6.2f}" if "curve_gbps" in x else " " * 17
        )
        checked = (
            f"{x['checked_floor_gbps']:>12.2f} {x['checked_floor_ratio']:>6.2f}"
            f" {x['of_checked_floor']:>6.2f}"
            if "checked_floor_gbps" in x
            else " " * 26
        )
        print(
            f"{x['tokens']:>7} {x['bytes'] / 2**20:>7.1f} {x['zmq_gbps']:>9.2f}"
            f" {x['raw_tcp_gbps']:>9.2f} {x['ratio']:>6.2f} {x['zmq_floor_gbps']:>10.2f}"
            f" {x['floor_ratio']:>6.2f} {x['of_floor']:>8.2f} {checked} {curve}"
            f" {x['cpu_ratio']:>9.2f}"
            f" {x['zmq_sender_cpu_ns_per_byte']:>7.2f} {x['zmq_receiver_cpu_ns_per_byte']:>7.2f}"
            f" {x['raw_cpu_ns_per_byte']:>8.2f} {x['floor_cpu_ns_per_byte']:>10.2f}  "
            + " ".join(f"{x['shares'][s]:>8.0%}" for s in STAGES)
        )
    print("raw GB/s: raw TCP taking turns with pdserve's transfers, in the same two processes")
    print("floor: ZeroMQ alone moving the same messages (no Ready, checksum, scatter or KVDone);")
    print("  its ratio to raw TCP (taking turns with it), and pdserve's ratio over it (of floor)")
    print("+checks: the floor with the decode's native hash and page write of each message,")
    print("  what any path that hashes a chunk before writing it pays here; its ratio to raw")
    print("  TCP, and pdserve's ratio over it (of it)")
    print("CPU ratio: raw TCP's CPU seconds per byte (its two threads) / ZeroMQ's (both processes)")
    print("tx / rx ns/B: ZeroMQ's CPU nanoseconds per byte in the sender / receiver process;")
    print("  raw / floor ns/B: CPU nanoseconds per byte of raw TCP's two threads / the floor's")
    print("  two processes")
    print("stage columns: share of the (checksums on, CURVE off) transfers' wall time")
    print("CPU ms per transfer by thread (the last round's ZeroMQ run, checksums on, CURVE off):")
    for x in results:
        sides = [
            f"{side}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(x["thread_cpu_ms"][side].items()))
            for side in ("decode", "prefill")
        ]
        print(f"{x['tokens']:>7}  " + "  |  ".join(sides))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=5, help="timed transfers per run")
    ap.add_argument("--rounds", type=int, default=3, help="(ZeroMQ, raw TCP) pairs per size")
    ap.add_argument("--frame-mib", type=float, default=MAX_FRAME_BYTES / 2**20)
    ap.add_argument("--no-curve", action="store_true", help="skip the CURVE-on runs")
    ap.add_argument(
        "--prefill-pages",
        choices=("runs", "shuffled"),
        default="runs",
        help="the prefill's pages: consecutive, as its allocator hands them out of a fresh "
        "pool (sent in place), or shuffled (a fragmented pool: gathered)",
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both pools live (cuda: gather into pinned staging, scatter from the host)",
    )
    ap.add_argument(
        "--ready",
        choices=("late", "first"),
        default="late",
        help="late: the prefill has computed the prompt when the decode's Ready comes (a "
        "decode that admits late; the sender hashes in place pieces before it comes); "
        "first: the prefill computes it once the Ready came, so every hash is on the path",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    keep_freed_memory()  # as the engine process does (the decode side runs here)
    results = [measure(n, args) for n in args.tokens]
    if args.json:
        print(json.dumps({"results": results}))
    else:
        print_table(results, args.repeats, args.prefill_pages, args.ready)


if __name__ == "__main__":
    main()
