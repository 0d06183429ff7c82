"""Frontend <-> engine process messages (ZeroMQ `ipc://`, msgpack via msgspec).

The one module both sides of that boundary import: the frontends (`pdserve.server`)
never import the engines (`pdserve.scheduler`), they start an engine process with
an `EngineSpec` and speak these types to it.

    frontend PUSH ──ToEngine──▶ engine PULL      (GenerateReq | Abort | StatsReq | Shutdown)
    frontend PULL ◀─FromEngine── engine PUSH     (EngineReady | Events | Stats | Heartbeat | EngineError)

Every message is a tagged Struct; the tag carries the protocol version, so a
frontend and an engine of different versions refuse each other's messages
(decode error) instead of misreading them; only typed msgspec crosses the socket.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from pdserve.config import EngineConfig, TransferConfig
from pdserve.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
_V = f"/v{PROTOCOL_VERSION}"


class EngineSpec(msgspec.Struct, kw_only=True):
    """What a frontend tells its engine process (sent as JSON on the command line)."""

    role: str  # "prefill" | "decode"
    engine: EngineConfig
    transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)


class EngineRequest(msgspec.Struct, kw_only=True):
    """What a frontend hands an engine (prefill or decode)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    room: int = 0  # 63-bit bootstrap_room chosen by the router; 0: not disaggregated
    bootstrap_host: str | None = None  # prefill's bootstrap address (decode side needs it)
    bootstrap_port: int | None = None
    # time.time() when the frontend handed the request over; the TTFT breakdown's
    # "arrive", so its first stage includes the wait in the engine's inbox (an engine
    # reads new requests between steps). 0: not stamped (the engine stamps its receipt).
    received_at: float = 0.0
    # time.time() stamps from before the frontend's handoff, by name (EDGE_STAMPS:
    # edge/stamps.py); an engine keeps those among its request's stages
    stamps: dict[str, float] = msgspec.field(default_factory=dict)
    # the client's rid when this is one of its n > 1 samples (rid "<group>-<i>"): the
    # frontend's /abort_request by that rid ends exactly these samples. The engine ignores it.
    group: str | None = None


EDGE_STAMPS = ("router_at", "http_at")

# The error an engine refuses a request with when its queue is full; a frontend
# answers it with 503 and Retry-After (the client may try again), never a 500.
QUEUE_FULL = "server overloaded: the queue is full"


class TopLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """The k most likely tokens at one position, most likely first, with their logprobs
    (the model's distribution: before temperature, penalties and filters)."""

    ids: list[int]
    logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """Prompt tokens 1 .. L-1 (token 0 has no context): each one's logprob given the
    tokens before it, and the top k at its position. Packed little-endian (float32,
    int32) so that it fits the KV transfer's header with the first token
    (sampling_params.prompt_logprobs_problem bounds it)."""

    k: int
    chosen: bytes  # float32 [L-1]
    top_ids: bytes  # int32 [L-1, k], most likely first
    top_values: bytes  # float32 [L-1, k]

    @classmethod
    def pack(cls, chosen: list[float], top: list[TopLogprobs], k: int) -> PromptLogprobs:
        ids = [i for t in top for i in t.ids]
        values = [v for t in top for v in t.logprobs]
        return cls(k, _pack("<f", chosen), _pack("<i", ids), _pack("<f", values))

    def unpack(self) -> tuple[list[float], list[TopLogprobs]]:
        """(each token's logprob, its top k); raises ValueError on inconsistent sizes."""
        chosen = _unpack("<f", self.chosen)
        ids, values = _unpack("<i", self.top_ids), _unpack("<f", self.top_values)
        if len(ids) != len(values) or len(ids) != len(chosen) * self.k:
            raise ValueError("prompt logprobs of inconsistent sizes")
        k = self.k
        top = [TopLogprobs(ids[j * k : j * k + k], values[j * k : j * k + k])
               for j in range(len(chosen))]  # fmt: skip
        return chosen, top


def _pack(fmt: str, values: list[Any]) -> bytes:
    return struct.pack(f"{fmt[0]}{len(values)}{fmt[1]}", *values)


def _unpack(fmt: str, data: bytes) -> list[Any]:
    if len(data) % 4:
        raise ValueError("packed logprobs of a size not a multiple of 4")
    return list(struct.unpack(f"{fmt[0]}{len(data) // 4}{fmt[1]}", data))


class PrefillLogprobs(msgspec.Struct, kw_only=True, frozen=True):
    """What the prefill computed for a request that asked, carried to the decode with the
    first token: the top k at the first output position, and the prompt's logprobs."""

    first_top: TopLogprobs | None = None
    prompt: PromptLogprobs | None = None


class TokenEvent(msgspec.Struct, kw_only=True):
    """Engine -> frontend: new tokens of one request, possibly its terminal state.

    Exactly one event per request has `finished=True`; it carries either a
    `finish_reason` ("stop" | "length" | "abort") or an `error` message.
    """

    rid: str
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    # one per token of `token_ids` when the request asked for top_logprobs
    top_logprobs: list[TopLogprobs] = msgspec.field(default_factory=list)
    # with a request's first token, when it asked for prompt_logprobs
    prompt_logprobs: PromptLogprobs | None = None
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    # stage timestamps (time.time()) for the TTFT breakdown, sent with the final event
    stages: dict[str, float] = msgspec.field(default_factory=dict)


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
    """TokenEvents in the order the engine produced them (a step sends one or more)."""

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
