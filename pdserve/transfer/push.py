"""Prefill-side state of one room and how its KV goes on the wire.

A room's chunks are frame-sized pieces of the prompt, each one KVChunk header plus
a K frame and a V frame gathered from the room's (scattered) slots:

    prompt positions  [0 ........ n)   split into pieces of <= max_tokens
    frame             [layers, piece tokens, kv_heads, head_dim]   C-contiguous

Pipeline (each row its own thread; chunk i+1's gather runs while chunk i is on the wire):

    sender I/O thread    gather K_i │ gather V_i │ send_i ─▶ gather K_i+1 │ ...
    kv-hash thread                  │ hash K_i  │
    libzmq I/O (sender)                          └─ write_i to the socket ──────▶
    libzmq I/O (decode)                            read_i into a frame ─▶ read_i+1 ...
    decode I/O thread                                        verify_i │ scatter_i │ verify_i+1

The staging buffer a frame is gathered into is the buffer libzmq sends from (copy=False);
it goes back to the pool only when its tracker says libzmq is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kvcache.pools import KVLayout, KVPool
from pdserve.transfer import stages
from pdserve.transfer.base import Ticket
from pdserve.transfer.checksum import combine, frame_hash, hash_async
from pdserve.transfer.messages import KVChunk, KVDone, Ready, done_digest
from pdserve.transfer.staging import StagingPool
from pdserve.transfer.zmq_io import MsgSocket


@dataclass
class Room:
    room: int
    req: Ticket | None = None  # set by on_admit
    ready: Ready | None = None  # set when the decode's Ready arrives
    peer: bytes = b""  # decode's identity on the bootstrap ROUTER
    pending: list[tuple[KVPool, torch.Tensor, int, int]] = field(default_factory=list)
    done: tuple[int, float] | None = None  # (first_token, first_logprob) from on_done
    stages: dict[str, float] = field(default_factory=dict)  # from on_done, for KVDone
    sent: list[tuple[int, int]] = field(default_factory=list)  # (chunk index, checksum)
    done_sent: bool = False
    deadline: float = 0.0


def phase(st: Room) -> str:
    if st.req is None:
        return "wait_admit"
    if st.ready is None:
        return "wait_ready"
    return "wait_ack" if st.done_sent else "pushing"


class Pusher:
    """Builds and sends a room's KVChunk / KVDone messages (I/O thread only)."""

    def __init__(self, layout: KVLayout, max_frame_bytes: int) -> None:
        self.layout = layout
        per_token = layout.token_bytes_per_layer * layout.num_layers
        self.max_tokens = max(1, max_frame_bytes // per_token)
        self._staging: StagingPool | None = None  # made on first use (pool dtype, device)

    def send_chunk(
        self, sock: MsgSocket, st: Room, pool: KVPool, idx: torch.Tensor, tok: int
    ) -> None:
        """Send KV of positions [tok, tok + len(idx)) whose slots are `idx`."""
        assert st.ready is not None and len(idx) <= self.max_tokens
        idx = idx.to(pool.k.device)
        staging = self._staging_for(pool)
        k_buf, k = staging.gather(pool.k, idx)
        k_hash = hash_async(k)  # NOTE: K is not written again until its tracker is done
        v_buf, v = staging.gather(pool.v, idx)
        with stages.timed("checksum"):  # V here, K on a helper thread during V's gather
            checksum = combine([k_hash.result(), frame_hash(v)])
        hdr = KVChunk(
            room=st.room,
            session=st.ready.session,
            index=len(st.sent),
            layer_start=0,
            layer_end=self.layout.num_layers,
            tok_start=tok,
            tok_end=tok + len(idx),
            kind="kv",
            dtype=self.layout.dtype,
            nbytes=k.nbytes,
            checksum=checksum,
        )
        st.sent.append((hdr.index, hdr.checksum))
        with stages.timed("send"):
            trackers = sock.send(hdr, [k, v])
        # NOTE: staging buffers return to the pool only when libzmq is done with them
        staging.hold(k_buf, trackers)
        staging.hold(v_buf, trackers)

    def send_done(self, sock: MsgSocket, st: Room) -> None:
        assert st.ready is not None and st.req is not None and st.done is not None
        done = KVDone(
            room=st.room,
            session=st.ready.session,
            first_token=st.done[0],
            first_logprob=st.done[1],
            prompt_len=st.req.prompt_len,
            num_chunks=len(st.sent),
            digest=done_digest(st.sent, *st.done, st.req.prompt_len),
            stages=st.stages,
        )
        sock.send(done)
        st.done_sent = True

    def _staging_for(self, pool: KVPool) -> StagingPool:
        if self._staging is None:
            lay = self.layout
            numel = self.max_tokens * lay.num_layers * lay.num_kv_heads * lay.head_dim
            self._staging = StagingPool(
                numel, pool.k.dtype, pin=pool.k.is_cuda, page_size=lay.page_size
            )
        return self._staging
