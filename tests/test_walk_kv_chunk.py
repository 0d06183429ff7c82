"""The decode's path of one KV chunk goes one way: from the moment the receiver's data
socket yields a KVChunk until the function that received it returns (its pages
written), each pdserve file is entered at most twice.

The walk is the sequence of Python frames the receiver's I/O thread makes in that
window, in the order they are made, kept where their code is in pdserve/ (a
comprehension or generator expression counts as part of the function it is written
in); a visit is a maximal run of consecutive frames of one file. A path that goes back
and forth between modules (receiver -> validate -> staging -> validate -> staging ...)
enters a file again each time.

One real transfer on loopback (KVSender -> KVReceiver), traced by a profile hook set
for the threads started here; each of its chunks (K, then V) is one walk.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch

from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.loopback import (
    Side,
    make_req,
    push_prompt,
    random_pool,
    reserve,
    transfer_settings,
    wait_for,
)
from pdserve.transfer.messages import KVChunk
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.sender import KVSender
from pdserve.transfer.zmq_io import MsgSocket

pytestmark = pytest.mark.timeout(60)

PKG = Path(__file__).resolve().parents[1] / "pdserve"
MOST_VISITS = 2
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
N = 64  # one piece: one K chunk, one V chunk
INLINE = {"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"}
RECV = MsgSocket.recv.__code__


class Walks:
    """A profile hook: the walk of each chunk a receiver takes (module docstring)."""

    def __init__(self) -> None:
        self.walks: list[list[str]] = []
        self._local = threading.local()  # this thread's walk, and the frame that ends it

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        mine = self._local
        until = getattr(mine, "until", None)
        if until is None:
            if event == "return" and frame.f_code is RECV and _is_chunk(arg):
                mine.until, mine.walk = frame.f_back, []
            return
        if event == "call":
            code = frame.f_code
            if code.co_name not in INLINE and code.co_filename.startswith(str(PKG)):
                mine.walk.append(str(Path(code.co_filename).relative_to(PKG)))
        elif event == "return" and frame is until:
            mine.until = None
            self.walks.append(mine.walk)


def _is_chunk(ret: object) -> bool:
    return isinstance(ret, tuple) and len(ret) == 3 and isinstance(ret[1], KVChunk)


def visits(walk: list[str]) -> dict[str, int]:
    """file -> how many maximal runs of consecutive frames the walk has in it."""
    out: dict[str, int] = {}
    for file, _ in itertools.groupby(walk):
        out[file] = out.get(file, 0) + 1
    return out


def test_visits_counts_runs_not_frames() -> None:
    assert visits(["a", "a", "b", "a", "c", "c"]) == {"a": 2, "b": 1, "c": 1}


@pytest.fixture
def walks() -> Iterator[Walks]:
    hook = Walks()
    threading.setprofile(hook)  # NOTE: threads started from now on (the I/O threads)
    try:
        yield hook
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]


def one_transfer(
    prefill_runs: bool, decode_pages: bool, native: bool
) -> tuple[KVSender, KVReceiver]:
    """A transfer of N tokens. `prefill_runs`: the prefill's slots in the allocator's
    order (sent in place) or shuffled (gathered into one packed frame per kind);
    `decode_pages`: the decode's slots whole pages (its writer) or slots scattered over
    the pool (written row by row); `native`: the C page I/O or the portable one."""
    tx = KVSender(LAYOUT, transfer_settings(heartbeat_interval_s=0.1), native=native)
    rx = KVReceiver(LAYOUT, transfer_settings(kv_timeout_s=10), native_scatter=native)
    pre = random_pool(LAYOUT, N + 8, seed=1)
    dec = random_pool(LAYOUT, N + 40, seed=2)
    prefill = Side(pre, *reserve(pre, N, seed=3, shuffle=not prefill_runs))
    if decode_pages:
        decode = Side(dec, *reserve(dec, N, seed=4))
    else:
        slots = torch.randperm(dec.k.shape[1], generator=torch.Generator().manual_seed(5))[:N]
        decode = Side(dec, [], slots)
    req = make_req("r", 7, N, tx.bootstrap_port)
    rx.announce(req)
    rx.expect(req, decode.pool, decode.slots)
    push_prompt(tx, req, prefill, chunk=N)
    events = wait_for(rx.poll, 1, timeout_s=20)
    assert [e.ok for e in events] == [True], events
    assert torch.equal(dec.k[:, decode.slots], pre.k[:, prefill.slots])
    assert torch.equal(dec.v[:, decode.slots], pre.v[:, prefill.slots])
    return tx, rx


@pytest.mark.parametrize("native", [True, False], ids=["native", "portable"])
@pytest.mark.parametrize(
    "prefill_runs, decode_pages",
    [(True, True), (False, True), (True, False)],
    ids=["in-place-to-pages", "packed-to-pages", "in-place-to-rows"],
)
def test_a_chunk_enters_each_file_at_most_twice(
    walks: Walks, prefill_runs: bool, decode_pages: bool, native: bool
) -> None:
    tx, rx = one_transfer(prefill_runs, decode_pages, native)
    tx.close()
    rx.close()
    assert len(walks.walks) == 2, walks.walks  # the K chunk, the V chunk
    for walk in walks.walks:
        assert "transfer/receiving/writer.py" in walk  # the pages were written in the window
        seen = visits(walk)
        again = {f: n for f, n in seen.items() if n > MOST_VISITS}
        path = " -> ".join(f for f, _ in itertools.groupby(walk))
        assert not again, f"entered more than {MOST_VISITS} times: {again}\n{path}"
