"""The decode's KV write into a CUDA pool has landed when write_chunk returns (skipped
without a GPU).

The receiver's I/O thread writes received frames on its own CUDA stream; the decode's
forward stream reads the slots as soon as the transfer is reported, without waiting
for that stream. To provoke the race, the I/O stream is held busy (`torch.cuda._sleep`)
before the write, and a reader on another stream looks at the slots the moment
write_chunk returns: it must see the frame's bytes, and sees the old ones when the
wait (writer.land) is removed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kvcache.pools import KVLayout
from pdserve.transfer.loopback import make_req, random_pool, reserve
from pdserve.transfer.messages import KVChunk, block_hashes, chunk_checksum
from pdserve.transfer.receiving import validate, writer
from pdserve.transfer.receiving.payload import received
from pdserve.transfer.receiving.transfer import Transfer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the race is between CUDA streams"
)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16)
N = 300
SLEEP_CYCLES = 300_000_000  # ~0.2 s: the I/O stream is busy when the write is queued


def _write_then_read(land_wait: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the K frame as sent, the pool's K at the slots as a reader on another stream sees
    it right after write_chunk returns)."""
    if not land_wait:
        monkeypatch.setattr(writer, "land", lambda device: None)
    pool = random_pool(LAYOUT, N + 64, 1, "cuda")
    _, slots = reserve(pool, N, 2)
    x = Transfer(make_req("r", 5, N, 0), pool, slots.cuda(), session=1, endpoint="")
    shape = (LAYOUT.num_layers, N, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    sent = [torch.randn(shape) for _ in range(2)]
    frames = [t.numpy().tobytes() for t in sent]
    hashes = block_hashes([t[j].numpy().tobytes() for t in sent for j in range(len(t))])
    h = KVChunk(room=5, session=1, index=0, layer_start=0, layer_end=LAYOUT.num_layers,
                tok_start=0, tok_end=N, kind="kv", dtype="float32", nbytes=len(frames[0]),
                checksum=chunk_checksum(hashes), hashes=hashes)  # fmt: skip
    chunk = received(LAYOUT, h, [memoryview(f) for f in frames])
    assert validate.check_chunk(LAYOUT, x, chunk) == ""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # on this thread's stream, ahead of the write
    assert writer.write_chunk(x, chunk) == ""
    reader = torch.cuda.Stream()  # as the decode's forward stream: it waits on no I/O stream
    with torch.cuda.stream(reader):
        seen = pool.k[:, x.slots].clone()
    reader.synchronize()
    torch.cuda.synchronize()
    return sent[0], seen.cpu()


def test_write_has_landed_when_write_chunk_returns(monkeypatch) -> None:
    sent, seen = _write_then_read(True, monkeypatch)
    assert torch.equal(seen, sent)


def test_without_the_wait_a_reader_sees_stale_kv(monkeypatch) -> None:
    sent, seen = _write_then_read(False, monkeypatch)
    assert not np.array_equal(seen.numpy(), sent.numpy())
