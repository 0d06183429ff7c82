"""checkpoints/gguf/index.py gives the tensors gguf's own reader gives (names, types,
shapes, the bytes of each view) while stepping over the metadata, on files of every
layout the tests write (quantized, plain float, BF16 as raw bytes as gguf keeps it; each
with a vocabulary's string array to step over)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_files import write_random_gguf

from pdserve.checkpoints.gguf.index import read_index


def _same_as_reader(path) -> None:
    ours, reader = read_index(path), gguf.GGUFReader(str(path), "c")
    assert all(t.field is None for t in ours.tensors), "the index, not its fallback"
    assert ours.architecture == str(reader.fields["general.architecture"].contents())
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(ours.tensors, reader.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data_offset == b.data_offset and a.n_bytes == b.n_bytes, a.name
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "F16", "F32", "BF16", "IQ4_XS"])
def test_the_index_equals_ggufs_reader(tmp_path, qtype) -> None:
    _same_as_reader(write_random_gguf(tmp_path / f"r-{qtype}.gguf", qtype))


def test_a_file_it_cannot_step_over_is_read_by_gguf(tmp_path) -> None:
    path = write_random_gguf(tmp_path / "r.gguf", "Q8_0")
    raw = bytearray(path.read_bytes())
    raw[4:8] = (1).to_bytes(4, "little")  # a GGUF version it does not know
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError):  # gguf's reader refuses version 1 too: it was asked
        read_index(path)
