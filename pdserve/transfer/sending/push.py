"""How a room's KV goes on the wire: Pusher builds and sends its messages.

A room's KV leaves in frame-sized pieces of the prompt; each piece is two KVChunk
messages, K then V, each one header plus one frame gathered from the room's
(scattered) slots:

    prompt positions  [0 ........ n)   split into pieces of <= max_tokens
    frame             [layers, piece tokens, kv_heads, head_dim]   C-contiguous

Pipeline (each row its own thread): K goes on the wire, and the decode verifies and
writes it, while V is gathered; the next piece's K is gathered while V is on the wire.

    sender I/O thread    gather+hash K_i │ gather+hash V_i │ gather+hash K_i+1 │ ...
    libzmq I/O (sender)                  └ write K_i ──────└ write V_i ─────────▶
    libzmq I/O (decode)                    read K_i ─────────read V_i ──────────▶
    decode I/O thread                           verify, scatter K_i │ verify, scatter V_i

(K and V go as two messages: one two-frame message would serialise them, and at 1k
tokens one message is the whole transfer, with nothing to overlap.)
The staging buffer a frame is gathered into is the buffer libzmq sends from (copy=False);
it goes back to the pool only when its tracker says libzmq is done. On a CPU pool whose
request slots are whole pages (as the pool hands them out) the native kernel gathers
page by page, layer after layer on the engine's kernel threads, and hashes each layer
while it is still in the cache of the core that copied it (kernels/native/page_copy.py
gather_runs); the kind's frame then carries runs [n], its layers' segments one after
another (messages.py), and the checksum is the one in-place pieces have. That reads
each byte from memory once, where torch's gather and a hash after it read it twice.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pdserve.kernels.page_io import PORTABLE, PageIO
from pdserve.kvcache.pools import KVLayout, KVPool
from pdserve.transfer import stages
from pdserve.transfer.checksum import block_hashes, blocks_of, chunk_checksum
from pdserve.transfer.messages import MAX_HEADER_BYTES, KVChunk, KVDone, done_digest
from pdserve.transfer.pages import PageViews, PoolPages, request_pages
from pdserve.transfer.sending.pieces import MAX_RUNS, InPlace, Made, Piece, in_place, zero_copy
from pdserve.transfer.sending.room import Room
from pdserve.transfer.sending.staging import StagingPool
from pdserve.transfer.zmq_io import MsgSocket
from pdserve.transfer.zmq_native import Frames


class Pusher:
    """Builds and sends a room's KVChunk / KVDone messages (I/O thread only)."""

    def __init__(
        self,
        layout: KVLayout,
        max_frame_bytes: int,
        pages: PageIO = PORTABLE,
        native_send: bool = False,
    ) -> None:
        """`pages`: the engine's page I/O (kernels/page_io.py), which gathers and hashes
        pieces whose pages are scattered over a CPU pool (gather_runs) and hashes the rest.
        `native_send`: the sockets send numpy frames through libzmq's C API
        (zmq_native.py), so prepare() makes a piece's frames for that, else pyzmq's."""
        self.layout = layout
        self._make: Callable[[list[np.ndarray]], Made] = Frames if native_send else zero_copy
        per_token = layout.token_bytes_per_layer * layout.num_layers
        self.max_tokens = max(1, max_frame_bytes // per_token)
        # NOTE: a chunk's block hashes travel in its header, which the decode drops unread
        # past MAX_HEADER_BYTES: a kind's bytes (<= max_frame_bytes, or one token's) in
        # blocks, plus a shorter last block per segment (layers * MAX_RUNS at most)
        most = max(max_frame_bytes, per_token)
        hashes = 8 * (blocks_of(most) + layout.num_layers * MAX_RUNS)
        if hashes > MAX_HEADER_BYTES // 2:
            raise ValueError(
                f"max_frame_bytes {max_frame_bytes}: a chunk's block hashes ({hashes} bytes)"
                f" would not fit in a header of {MAX_HEADER_BYTES // 2} bytes"
            )
        self._staging: StagingPool | None = None  # made on first use (pool dtype, device)
        self._pages = pages
        self._pool_pages = PoolPages()
        # pieces sent each way (KVSender.stats): how often serving's pages allow in place
        self.pieces = {"pieces_in_place": 0, "pieces_gathered": 0}

    def prepare(self, piece: Piece) -> None:
        """Hash `piece` now, if it goes in place, so its sends need no hashing.

        For a room whose KV is computed before the decode's Ready comes (a decode that
        admits late): the hashes are ready when it comes, and the piece's first byte goes
        on the wire without waiting for them. The pool's bytes for these slots are final
        (the prefill computed them) and stay untouched until the room's pages are freed."""
        if piece.prepared is None:
            piece.prepared = in_place(piece)
        p = piece.prepared
        if p is not None and p.hashes is None:
            with stages.timed("prepare"):
                pages = self._pages
                p.hashes = (block_hashes(p.frames[0], pages), block_hashes(p.frames[1], pages))
                p.zframes = (self._make(p.frames[0]), self._make(p.frames[1]))

    def send_chunk(self, sock: MsgSocket, st: Room, piece: Piece) -> None:
        """Send `piece`: a K chunk, then a V chunk, so K is on the wire (and verified,
        written) while V is gathered."""
        assert st.ready is not None and piece.end - piece.start <= self.max_tokens
        p = piece.prepared or in_place(piece)
        if p is not None:
            self.pieces["pieces_in_place"] += 1
            self._send_in_place(sock, st, p, piece.start, piece.end - piece.start)
            return
        self.pieces["pieces_gathered"] += 1
        pool, tok, n = piece.pool, piece.start, piece.end - piece.start
        staging = self._staging_for(pool)
        paged = self._paged(piece)
        if paged is not None:
            self._send_gathered_pages(sock, st, piece, staging, *paged)
            return
        idx = piece.slots[piece.start : piece.end].to(pool.k.device)
        for kind, src in (("k", pool.k), ("v", pool.v)):
            buf, frame = staging.gather(src, idx)  # [layers, n, row bytes]: a segment per layer
            hdr = self._header(st, kind, tok, n, list(frame), frame.nbytes)
            with stages.timed("send"):
                trackers = sock.send(hdr, [frame])
            # NOTE: a staging buffer returns to the pool only when libzmq is done with it
            staging.hold(buf, trackers)

    def _paged(self, piece: Piece) -> tuple[PageViews, np.ndarray, int] | None:
        """Where the page gather reads `piece`: its pool as pages, the pages holding
        its positions in order, and its first position's row in the first of them; None
        for a pool on a GPU, or slots not in whole pages."""
        if piece.pool.k.is_cuda:
            return None
        size = self.layout.page_size
        base = piece.start - piece.start % size
        pages = request_pages(piece.slots[base : piece.end].numpy(), size)
        views = self._pool_pages.of(piece.pool)
        if pages is None or views[0] is None or views[1] is None:
            return None
        return views, pages, piece.start - base

    def _send_gathered_pages(
        self,
        sock: MsgSocket,
        st: Room,
        piece: Piece,
        staging: StagingPool,
        views: PageViews,
        pages: np.ndarray,
        t0: int,
    ) -> None:
        """K, then V, of `piece` gathered page by page into staging, each as one frame
        of its layers' segments one after another (runs [n]: messages.py), each layer
        hashed on the kernel threads as soon as it is filled, while it is still in that
        core's cache."""
        tok, n = piece.start, piece.end - piece.start
        for kind, src in zip("kv", views):
            assert src is not None
            buf, rows, hashes = staging.gather_pages(src, pages, t0, n, self._pages)
            hdr = self._header(st, kind, tok, n, list(rows), rows.nbytes, [n], hashes)
            with stages.timed("send"):
                trackers = sock.send(hdr, [rows.reshape(-1)])
            # NOTE: a staging buffer returns to the pool only when libzmq is done with it
            staging.hold(buf, trackers)

    def _send_in_place(self, sock: MsgSocket, st: Room, p: InPlace, tok: int, n: int) -> None:
        """K, then V, of positions [tok, tok + n) as one frame per (layer, run), read by
        libzmq straight from the pool's pages (the module docstring); hashed here unless
        prepare() did."""
        sums = p.hashes or (None, None)
        made, p.zframes = p.zframes, None  # sent once: no reference may outlive the send
        for i, (kind, frames, hashes) in enumerate(zip("kv", p.frames, sums)):
            nbytes = sum(f.nbytes for f in frames)
            counts = [c for _, c in p.runs]
            hdr = self._header(st, kind, tok, n, frames, nbytes, counts, hashes)
            with stages.timed("send"):
                st.inflight += sock.send(hdr, made[i] if made else frames)
        del made

    def _header(
        self,
        st: Room,
        kind: str,
        tok: int,
        n: int,
        segments: list,
        nbytes: int,
        runs: list[int] | None = None,
        hashes: bytes | None = None,
    ) -> KVChunk:
        """The KVChunk for `segments` (hashed here unless `hashes` are their block
        hashes), recorded in st.sent."""
        assert st.ready is not None
        if hashes is None:
            with stages.timed("checksum"):
                hashes = block_hashes(segments, self._pages)
        hdr = KVChunk(
            room=st.room,
            session=st.ready.session,
            index=len(st.sent),
            layer_start=0,
            layer_end=self.layout.num_layers,
            tok_start=tok,
            tok_end=tok + n,
            kind=kind,
            dtype=self.layout.dtype,
            nbytes=nbytes,
            checksum=chunk_checksum(hashes),
            hashes=hashes,
            runs=runs or [],
        )
        st.sent.append((hdr.index, hdr.checksum))
        return hdr

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
