"""Frontend <-> engine process messages (ZeroMQ `ipc://`, msgpack via msgspec).

    frontend PUSH ──ToEngine──▶ engine PULL      (GenerateReq | Abort | StatsReq | Shutdown)
    frontend PULL ◀─FromEngine── engine PUSH     (EngineReady | Events | Stats | Heartbeat | EngineError)

Every message is a tagged Struct; the tag carries the protocol version, so a
frontend and an engine of different versions refuse each other's messages
(decode error) instead of misreading them; only typed msgspec crosses the socket.
"""

from __future__ import annotations

import msgspec

from pdserve.scheduler.request import EngineRequest, TokenEvent

PROTOCOL_VERSION = 1
_V = f"/v{PROTOCOL_VERSION}"


class _Msg(msgspec.Struct, tag_field="t", kw_only=True):
    pass


# ---- frontend -> engine ---------------------------------------------------------------
class GenerateReq(_Msg, tag="generate" + _V):
    req: EngineRequest


class Abort(_Msg, tag="abort" + _V):
    rid: str
    reason: str = "aborted by client"


class StatsReq(_Msg, tag="stats_req" + _V):
    nonce: int  # echoed in the Stats reply


class Shutdown(_Msg, tag="shutdown" + _V):
    pass


# ---- engine -> frontend ---------------------------------------------------------------
class EngineReady(_Msg, tag="ready" + _V):
    role: str
    pid: int
    info: dict[str, str | int | float] = msgspec.field(default_factory=dict)


class Events(_Msg, tag="events" + _V):
    """All TokenEvents one engine step produced, in order."""

    events: list[TokenEvent]


class Stats(_Msg, tag="stats" + _V):
    nonce: int
    stats: dict[str, float]


class Heartbeat(_Msg, tag="heartbeat" + _V):
    time: float


class EngineError(_Msg, tag="engine_error" + _V):
    """The engine failed (build or step raised); it exits right after sending this."""

    message: str


ToEngine = GenerateReq | Abort | StatsReq | Shutdown
FromEngine = EngineReady | Events | Stats | Heartbeat | EngineError

_encoder = msgspec.msgpack.Encoder()
to_engine_decoder: msgspec.msgpack.Decoder[ToEngine] = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder: msgspec.msgpack.Decoder[FromEngine] = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def ipc_paths(ipc_dir: str) -> tuple[str, str]:
    """(to_engine, from_engine) endpoints inside `ipc_dir`; the frontend binds both."""
    return f"ipc://{ipc_dir}/to_engine", f"ipc://{ipc_dir}/from_engine"
