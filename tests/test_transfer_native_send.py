"""transfer/zmq_native.py: KV frames sent through libzmq's C API.

The Pending of a message is its only guard: a prefill frees a room's pages, or reuses a
staging buffer, once it is done. These tests hold libzmq on a frame (a PUSH with no peer
queues it) and check that the Pending is not done until libzmq lets the frame go, that
every path (sent, discarded at close, refused) ends done, and that frames dropped by
the caller early stay alive until then.
"""

from __future__ import annotations

import gc
import socket
import time
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from pdserve.envs import cache_root
from pdserve.transfer.messages import Decoder, Heartbeat
from pdserve.transfer.zmq_io import MsgSocket, make_socket
from pdserve.transfer.zmq_native import Frames, NativeSend, Pending, native_send


@pytest.fixture
def native() -> NativeSend:
    ns = native_send(cache_root())
    if ns is None:
        pytest.skip("libzmq's C API not reachable here (or no C compiler)")
    return ns


def frames_of(seed: int, n: int = 4, size: int = 1 << 16) -> tuple[np.ndarray, list[np.ndarray]]:
    rows = np.random.default_rng(seed).integers(0, 255, (n, size), dtype=np.uint8)
    return rows, [rows[i] for i in range(n)]


def pair() -> tuple[zmq.Socket, zmq.Socket]:
    pull = make_socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = make_socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    return pull, push


@pytest.fixture
def peerless_push() -> Iterator[zmq.Socket]:
    """A PUSH connected to a TCP listener that never answers ZeroMQ's greeting: the
    connection never becomes a peer, so libzmq queues what it is sent. (A port closed
    after binding it, as before, could be taken by another socket of the test process
    meanwhile, and the PUSH then delivered: seen once in a full `make test`.)"""
    silent = socket.create_server(("127.0.0.1", 0))
    push = make_socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{silent.getsockname()[1]}")
    try:
        yield push
    finally:
        push.close(linger=0)
        silent.close()


def test_a_message_arrives_whole_and_its_pending_is_done_after(native: NativeSend) -> None:
    pull, push = pair()
    try:
        rows, frames = frames_of(1)
        p = native.send(push, b"header bytes", Frames(frames))
        parts = pull.recv_multipart()
        assert parts[0] == b"header bytes"
        assert [bytes(x) for x in parts[1:]] == [r.tobytes() for r in rows]
        p.wait(5)
        assert p.done
    finally:
        push.close()
        pull.close()


def test_pending_stays_open_while_libzmq_holds_a_frame(
    native: NativeSend, peerless_push: zmq.Socket
) -> None:
    """The fence: until libzmq lets go (here: the socket closed, its queue discarded),
    the frames may still be read, so the Pending must not be done."""
    push = peerless_push
    _, frames = frames_of(2)
    p = native.send(push, b"h", Frames(frames))
    time.sleep(0.05)
    assert not p.done
    with pytest.raises(zmq.NotDone):
        p.wait(0.01)
    push.close(linger=0)
    p.wait(5)  # libzmq's reaper let every frame go
    assert p.done


def test_frames_dropped_by_the_caller_stay_alive_until_libzmq_lets_go(
    native: NativeSend, peerless_push: zmq.Socket
) -> None:
    push = peerless_push
    rows, frames = frames_of(3)
    alive = weakref.ref(rows)
    native.send(push, b"h", Frames(frames))  # the Pending is dropped at once
    del rows, frames
    gc.collect()
    assert alive() is not None  # kept: libzmq still holds the frames
    push.close(linger=0)
    end = time.monotonic() + 5
    while alive() is not None and time.monotonic() < end:
        Pending(None)  # a later send sweeps the orphans whose frames were let go
        gc.collect()
        time.sleep(0.01)
    assert alive() is None


def test_a_refused_send_raises_and_lets_its_frames_go(native: NativeSend) -> None:
    """Frames never handed to libzmq are counted off at once: nothing keeps them."""
    pull = make_socket(zmq.PULL)  # a PULL cannot send: libzmq refuses the header
    try:
        rows, frames = frames_of(4)
        alive = weakref.ref(rows)
        with pytest.raises(zmq.ZMQError):
            native.send(pull, b"h", Frames(frames))
        del rows, frames
        gc.collect()
        assert alive() is None  # an open count would have kept them (orphaned)
    finally:
        pull.close()


def test_msg_socket_sends_natively_only_without_a_hook(native: NativeSend) -> None:
    pull, push = pair()
    hooked = make_socket(zmq.PUSH)
    try:
        _, frames = frames_of(5, n=2)
        sock = MsgSocket(push, Decoder(), native=native)
        [tracker] = sock.send(Heartbeat(sender="x", seq=1), frames)
        assert isinstance(tracker, Pending)
        assert (
            MsgSocket(hooked, Decoder(), hook=lambda tag, parts: [parts], native=native).native
            is None
        )
        _, msg, got = MsgSocket(pull, Decoder(), limits=(3, 1 << 20)).recv()
        assert msg == Heartbeat(sender="x", seq=1)
        assert [bytes(f.buffer) for f in got] == [f.tobytes() for f in frames]
        assert not native.takes([frames[0][::2]]) and not native.takes([b"bytes"])
    finally:
        for s in (push, pull, hooked):
            s.close()
