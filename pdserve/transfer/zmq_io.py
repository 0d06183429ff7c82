"""The one typed ZeroMQ wrapper of the transfer: msgspec headers plus raw frames.

One context per process. Sockets are used only by the thread that created them.
`send` goes through an optional hook (the fault injector) that may drop, delay,
duplicate, reorder, truncate or corrupt whole multipart messages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.netaddr import is_ipv6_endpoint, is_loopback
from pdserve.transfer import stages
from pdserve.transfer.messages import MAX_HEADER_BYTES, Decoder, Message, encode
from pdserve.transfer.peer_guard import PeerGuard
from pdserve.transfer.zmq_native import Frames, NativeSend, Pending

log = logging.getLogger(__name__)

Frame = Any  # bytes, memoryview or contiguous numpy array: anything with a buffer
# libzmq's tracker of a frame (pyzmq) or of a whole message (zmq_native.Pending)
Tracker = zmq.MessageTracker | Pending
# hook(kind tag, frames) -> the multipart messages to really send (0, 1 or more).
# The frames are valid only during the call: a hook that keeps one must copy it.
SendHook = Callable[[str, list[Frame]], list[list[Frame]]]

_SOCK_BUF = 8 << 20  # kernel socket buffers: large frames stream without stalls


@dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE keys. A server needs public+secret; a client also the server's public key."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None

    @classmethod
    def generate(cls) -> CurveKeys:
        pub, sec = zmq.curve_keypair()
        return cls(pub, sec)

    def for_server(self, server_public: bytes) -> CurveKeys:
        return CurveKeys(self.public, self.secret, server_public)


def context() -> zmq.Context:
    return zmq.Context.instance()


MAX_WIRE_FRAME_BYTES = 64 << 20
# Complete messages queued for this process per peer connection: beyond it libzmq stops
# reading that peer (TCP pushes back), it drops nothing. A KV message is at most a few
# frames of max_frame_bytes, so this bounds what a peer parks here at about
# RCV_HWM * MAX_WIRE_FRAME_BYTES in theory, far less in practice (the sender's frames).
# NOTE: libzmq counts whole messages here and checks MAXMSGSIZE per frame: neither bounds
# ONE multipart message whose frames keep coming; peer_guard.py does (without CURVE), and
# CURVE by letting only holders of the cluster secret connect (docs/security.md).
RCV_HWM = 1000


def make_socket(
    kind: int, curve: CurveKeys | None = None, curve_server: bool = False, never_block: bool = False
) -> zmq.Socket:
    """`never_block`: a send with no pipe to a peer raises zmq.Again at once instead of
    waiting for one (the transfer's outbound DEALER and PUSH sockets: see below)."""
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDBUF, _SOCK_BUF)
    sock.setsockopt(zmq.RCVBUF, _SOCK_BUF)
    sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the engine's own admission, not by drops
    sock.setsockopt(zmq.RCVHWM, RCV_HWM)
    if never_block:
        # NOTE: a send never blocks the I/O thread: with no pipe to a peer (a DEALER or PUSH
        # whose connection failed its CURVE handshake has none) it raises zmq.Again at once
        sock.setsockopt(zmq.SNDTIMEO, 0)
    # A peer sending a larger frame is disconnected by ZeroMQ before we buffer it; every
    # legitimate frame (a header, or a KV frame of at most max_frame_bytes) is far below.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_FRAME_BYTES)
    if curve is not None:
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
        if curve_server:
            sock.curve_server = True
        else:
            assert curve.server_public is not None, "a CURVE client needs the server's public key"
            sock.curve_serverkey = curve.server_public
    return sock


def bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind to tcp://host:port (port 0: ephemeral); returns the bound port."""
    if not is_loopback(host) and not sock.getsockopt(zmq.CURVE_SERVER):
        log.warning(
            "SECURITY: the KV transfer socket binds %s without CURVE: any process that "
            "reaches this port can send it messages (and hold its memory) and read the KV "
            "it is sent. Set --curve-secret-key-file (or PDSERVE_CURVE_PUBLIC/SECRET) on "
            "every prefill and decode, or bind 127.0.0.1 (docs/security.md, ZeroMQ ports)",
            host,
        )
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{host}")
    sock.bind(f"tcp://{host}:{port}")
    return port


def connect(sock: zmq.Socket, endpoint: str) -> None:
    """Connect to an endpoint netaddr.endpoint_problem found nothing wrong with."""
    if is_ipv6_endpoint(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(endpoint)


def _tracked(f: Frame) -> bool:
    """A zmq.Frame made with a tracker (sending/pieces.zero_copy): sent as it is."""
    return isinstance(f, zmq.Frame) and f.tracker is not None


# A control message is one header frame; a KV message a header and its payload frames.
CONTROL_LIMITS = (1, MAX_HEADER_BYTES)  # (frames, bytes) of one whole message


class MsgSocket:
    """A socket that speaks `Message` headers followed by raw frames."""

    def __init__(
        self,
        sock: zmq.Socket,
        decoder: Decoder,
        hook: SendHook | None = None,
        native: NativeSend | None = None,
        limits: tuple[int, int] = CONTROL_LIMITS,
        guard: PeerGuard | None = None,
    ) -> None:
        """`native`: frames that are numpy arrays go through libzmq's C API (zmq_native.py),
        unless a hook is set (fault injection sees and sends pyzmq frames). `limits`: the
        most frames and bytes a whole message received may have (beyond: dropped as
        oversized, and logged). `guard`: hangs up a peer connection holding more than
        `limits` of an unfinished message (peer_guard.py)."""
        self.limits = limits
        self.sock = sock
        self.decoder = decoder
        self.hook = hook
        self.routed = sock.type == zmq.ROUTER
        self.native = native if hook is None and not self.routed else None
        self.guard = guard
        if guard is not None:  # a PUSH is sent nothing: any message to it is too much
            guard.watch(sock, (0, 0) if sock.type == zmq.PUSH else limits)

    def send(
        self, msg: Message, frames: Sequence[Frame] | Frames = (), to: bytes | None = None
    ) -> list[Tracker]:
        """Queue one message (never blocks: HWM is unlimited, and with no peer to take it
        it raises zmq.Again: make_socket's never_block). `frames` are sent zero-copy,
        every one however small (pyzmq would copy those under its copy threshold, and
        report them done at once); the returned trackers say when libzmq no longer reads
        them: one per message sent natively, else one per frame. A frame may come already
        made (a tracked zmq.Frame, made before its message was due: sending/pieces.zero_copy); its
        tracker is done only once the caller has dropped it too. `frames` may also come
        made for a native send (zmq_native.Frames, made before the message was due)."""
        if not frames and self.hook is None and not self.routed:  # a header alone (Ready,
            self.sock.send(encode(msg))  # Ack, KVDone): pyzmq copies one so small anyway
            return []
        if isinstance(frames, Frames):  # made for a native send (zmq_native.Frames)
            if self.native is not None:
                return [self.native.send(self.sock, encode(msg), frames)]
            frames = frames.arrays
        elif frames and self.native is not None and self.native.takes(frames):
            return [self.native.send(self.sock, encode(msg), Frames(frames))]
        parts: list[Frame] = [encode(msg), *frames]
        batches = self.hook(type(msg).__name__, parts) if self.hook else [parts]
        trackers: list[Tracker] = []
        for batch in batches:
            prefix: list[Frame] = [to] if (self.routed and to is not None) else []
            payload = [
                f if _tracked(f) else zmq.Frame(f, copy=False, track=True) for f in batch[1:]
            ]
            self.sock.send_multipart([*prefix, batch[0], *payload], copy=False)
            trackers += [f.tracker for f in payload]
        return trackers

    def recv(self, block: bool = True) -> tuple[bytes | None, Message | None, list[zmq.Frame]]:
        """Receive one multipart message (the I/O thread: after poll said readable, and
        `block` False, so a handler never waits whatever the poll said).

        Returns (peer identity or None, decoded header or None if dropped or, not
        `block`, none was there, payload frames).
        """
        with stages.timed("receive"):
            try:
                parts = self.sock.recv_multipart(0 if block else zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None, None, []
        peer = None
        if self.routed:
            peer, parts = parts[0].bytes, parts[1:]
        if self.guard is not None:
            self.guard.received(self.sock, parts)
        if len(parts) > self.limits[0] or sum(len(p) for p in parts) > self.limits[1]:
            self.decoder.dropped["oversized"] += 1
            log.warning("dropped a message of %d frames, %d bytes from %r (limits %s)",
                        len(parts), sum(len(p) for p in parts), peer, self.limits)  # fmt: skip
            return peer, None, []
        if not parts:
            self.decoder.dropped["malformed"] += 1
            return peer, None, []
        return peer, self.decoder.decode(parts[0].buffer), parts[1:]

    def close(self) -> None:
        if self.guard is not None:
            self.guard.forget(self.sock)
        self.sock.close(linger=0)
