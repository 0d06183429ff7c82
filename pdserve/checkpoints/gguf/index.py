"""A GGUF's tensors without its metadata: what an engine needs to serve the file's blocks.

`gguf.GGUFReader` turns every metadata value into numpy parts, a vocabulary's strings
one by one: 5-10 s for a 150k-262k token vocabulary on two cores, paid by each engine
at start-up. This index steps over the metadata (a string's length is all it reads) and
builds the tensors as gguf's own `ReaderTensor`s, views of one copy-on-write mapping, so
callers use them as they would the reader's. Only little-endian GGUF v2/v3 files take
this path; any other file is read by `gguf.GGUFReader` itself.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import gguf

_MAGIC = 0x46554747  # "GGUF", little-endian
_STRING, _ARRAY = 8, 9
# fixed sizes of the scalar value types (gguf's GGUFValueType numbering)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_DEFAULT_ALIGNMENT = 32


@dataclass
class TensorIndex:
    architecture: str
    tensors: list[gguf.ReaderTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return int(value)

    def string(self) -> bytes:
        n = self.take("<Q")
        self.at += n
        return bytes(self.buf[self.at - n : self.at])

    def skip(self, vtype: int) -> None:
        if vtype == _STRING:
            n = self.take("<Q")  # (not `self.at += self.take(...)`: that adds to the old at)
            self.at += n
        elif vtype == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALAR:
                self.at += _SCALAR[item] * count
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            self.at += _SCALAR[vtype]  # KeyError: an unknown type (the caller falls back)


def read_index(path: Path) -> TensorIndex:
    """The tensors of `path` (views of a copy-on-write mapping) and its architecture."""
    data = np.memmap(path, mode="c")
    try:
        return _index(data)
    except (KeyError, ValueError, struct.error, UnicodeDecodeError):
        return _with_reader(path)


def _index(data: np.memmap) -> TensorIndex:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape

    c = _Cursor(memoryview(data))  # type: ignore[arg-type]  # a memmap is a buffer
    if c.take("<I") != _MAGIC or c.take("<I") not in (2, 3):
        raise ValueError("not a little-endian GGUF v2/v3")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    arch, alignment = None, _DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, vtype = c.string(), c.take("<I")
        if key == b"general.architecture" and vtype == _STRING:
            arch = c.string().decode()
        elif key == b"general.alignment" and vtype == 4:
            alignment = c.take("<I")
        else:
            c.skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name = c.string().decode()
        dims = [c.take("<Q") for _ in range(c.take("<I"))]
        infos.append((name, dims, GGMLQuantizationType(c.take("<I")), c.take("<Q")))
    if arch is None:
        raise ValueError("no general.architecture")
    start = -(-c.at // alignment) * alignment
    tensors = []
    for name, dims, qtype, offset in infos:
        n = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))
        if qtype.name in _PLAIN:  # as gguf's reader: a numpy dtype, else the raw bytes
            dtype = np.dtype(_PLAIN[qtype.name])
            view = data[start + offset : start + offset + n * size].view(dtype).reshape(shape)
        else:
            view = data[start + offset : start + offset + n * size // block]
            view = view.reshape(quant_shape_to_byte_shape(shape, qtype))
        tensors.append(ReaderTensor(name=name, tensor_type=qtype, shape=np.array(dims, np.uint64),
                                    n_elements=n, n_bytes=n * size // block,
                                    data_offset=start + offset, data=view, field=None))  # type: ignore[arg-type]  # fmt: skip
    return TensorIndex(arch, tensors)


_PLAIN = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4",
          "I64": "<i8"}  # fmt: skip


def _with_reader(path: Path) -> TensorIndex:
    import gguf

    reader = gguf.GGUFReader(str(path), "c")
    arch = str(reader.fields["general.architecture"].contents())
    return TensorIndex(arch, list(reader.tensors))
