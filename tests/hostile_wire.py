"""Helpers of the hostile-peer tests (tests/test_hostile_wire_*.py): a real KVSender and
KVReceiver on loopback, a check that the same pair still moves KV byte-exact after an
attack, raw sockets that speak the wire format by hand, and the process's RSS."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import zmq

from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.loopback import (
    Side,
    gather,
    make_req,
    push_prompt,
    random_pool,
    reserve,
    transfer_settings,
    wait_for,
)
from pdserve.transfer.messages import Message, encode
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.sender import KVSender

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
N = 21  # prompt tokens of the transfers that check the pair still serves


@dataclass
class Pair:
    tx: KVSender
    rx: KVReceiver


@contextlib.contextmanager
def pair(**kw: float) -> Iterator[Pair]:
    """A sender and a receiver with short timers (`kw` overrides them by name)."""
    boot = kw.pop("bootstrap_timeout_s", 1.0)
    tx = KVSender(
        LAYOUT,
        transfer_settings(
            heartbeat_interval_s=0.1,
            heartbeat_timeout_s=kw.pop("peer", 1.0),
            kv_ready_timeout_s=kw.pop("ready", 30.0),
            kv_timeout_s=30.0,
            kv_bootstrap_timeout_s=boot,
        ),
    )
    rx = KVReceiver(
        LAYOUT,
        transfer_settings(
            kv_timeout_s=kw.pop("kv", 30.0),
            heartbeat_interval_s=0.1,
            heartbeat_timeout_s=1.0,
            kv_bootstrap_timeout_s=boot,
        ),
    )
    try:
        yield Pair(tx, rx)
    finally:
        tx.close()
        rx.close()


def serves(p: Pair, room: int = 9999) -> None:
    """One transfer through `p` lands byte-exact (the pair survived what came before)."""
    pp, dp = random_pool(LAYOUT, 64, room), random_pool(LAYOUT, 64, room + 1)
    pre, dec = Side(pp, *reserve(pp, N, 1)), Side(dp, *reserve(dp, N, 2))
    req = make_req(f"ok-{room}", room, N, p.tx.bootstrap_port)
    p.rx.expect(req, dec.pool, dec.slots)
    push_prompt(p.tx, req, pre, chunk=8)
    evs = [e for e in wait_for(p.rx.poll, 1, 10) if e.rid == req.rid]
    assert evs and evs[0].ok, evs
    assert torch.equal(gather(pre.pool, pre.slots)[0], gather(dec.pool, dec.slots)[0])
    assert torch.equal(gather(pre.pool, pre.slots)[1], gather(dec.pool, dec.slots)[1])


def raw(kind: int, endpoint: str) -> zmq.Socket:
    """A socket that speaks the wire by hand; never blocks on a send."""
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 1000)
    s.connect(endpoint) if kind != zmq.ROUTER else s.bind(endpoint)
    return s


def send(sock: zmq.Socket, msg: Message, to: bytes | None = None) -> None:
    sock.send_multipart([to, encode(msg)] if to is not None else [encode(msg)])


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")
