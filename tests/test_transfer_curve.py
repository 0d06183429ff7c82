"""CURVE on the transfer: same cluster keys -> bytes arrive; a stranger's keys -> refused."""

from __future__ import annotations

import contextlib

import pytest
import torch
import zmq

from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.curve import load_keys
from pdserve.transfer.loopback import (
    Side,
    gather,
    make_req,
    push_prompt,
    random_pool,
    reserve,
    transfer_settings,
    wait_for,
    wait_until,
)
from pdserve.transfer.messages import Ready, encode
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.sender import KVSender
from pdserve.transfer.zmq_io import CurveKeys, make_socket

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
N = 21


def transfer(tx_keys: CurveKeys, rx_keys: CurveKeys):
    tx = KVSender(LAYOUT, transfer_settings(heartbeat_interval_s=0.1), curve=tx_keys)
    rx = KVReceiver(
        LAYOUT, transfer_settings(kv_timeout_s=5, heartbeat_timeout_s=1.0), curve=rx_keys
    )
    try:
        pp, dp = random_pool(LAYOUT, 64, 1), random_pool(LAYOUT, 64, 2)
        pre, dec = Side(pp, *reserve(pp, N, 1)), Side(dp, *reserve(dp, N, 2))
        before = dp.k.clone()
        rx.expect(make_req("c", 1, N, tx.bootstrap_port), dec.pool, dec.slots)
        push_prompt(tx, make_req("c", 1, N, tx.bootstrap_port), pre, chunk=8)
        [ev] = wait_for(rx.poll, 1, 5)
        return ev, pre, dec, before
    finally:
        tx.close()
        rx.close()


def test_shared_cluster_keys_transfer() -> None:
    keys = CurveKeys.generate()
    ev, pre, dec, _ = transfer(keys, keys)
    assert ev.ok, ev.reason
    assert torch.equal(gather(pre.pool, pre.slots)[0], gather(dec.pool, dec.slots)[0])


def test_stranger_keys_refused() -> None:
    ev, _, dec, before = transfer(CurveKeys.generate(), CurveKeys.generate())
    assert not ev.ok and "silent" in ev.reason
    assert torch.equal(dec.pool.k, before)


def test_client_knowing_only_the_server_key_is_refused() -> None:
    """CURVE alone admits anyone who knows the (public) server key; ZAP must not."""
    keys = CurveKeys.generate()
    tx = KVSender(LAYOUT, transfer_settings(heartbeat_interval_s=0.1), curve=keys)
    intruder = make_socket(zmq.DEALER, CurveKeys.generate().for_server(keys.public))
    try:
        intruder.connect(f"tcp://127.0.0.1:{tx.bootstrap_port}")
        ready = Ready(
            room=5,
            session=1,
            data_endpoint="tcp://127.0.0.1:1",
            layout=LAYOUT.fingerprint(),
            num_tokens=N,
            decode_id="x",
        )
        # NOTE: never blocks: once ZAP refused the connection the DEALER has no pipe, and
        # a blocking send would wait forever (make_socket's SNDTIMEO 0 raises zmq.Again)
        with contextlib.suppress(zmq.Again):
            intruder.send(encode(ready), zmq.NOBLOCK)
        assert not wait_until(lambda: bool(tx.active_rooms()), 1.0)
    finally:
        intruder.close(linger=0)
        tx.close()


def test_load_keys_from_env(monkeypatch) -> None:
    keys = CurveKeys.generate()
    monkeypatch.setenv("PDSERVE_CURVE_PUBLIC", keys.public.decode())
    monkeypatch.setenv("PDSERVE_CURVE_SECRET", keys.secret.decode())
    assert load_keys() == keys
    monkeypatch.delenv("PDSERVE_CURVE_SECRET")
    with pytest.raises(ValueError):
        load_keys()
