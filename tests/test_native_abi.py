"""Every struct Python hands a native library has the layout the library was compiled
with (kernels/native/abi.py, abi.h): checked field by field when it loads, and a field
on one side only refuses the load, naming the struct and the field."""

from __future__ import annotations

import ctypes
import re
import shutil
from pathlib import Path

import pytest

from pdserve.kernels.native import abi, library
from pdserve.kernels.native.abi import AbiMismatch
from pdserve.transfer import zmq_native

LIBS: dict[str, abi.Structs] = {**abi.STRUCTS, "zmq_send": (zmq_native.ZmqApi,)}
SRC_DIRS = {"zmq_send": zmq_native.SRC_DIR}
PAIRS = [(name, s.__name__) for name, structs in sorted(LIBS.items()) for s in structs]

needs_cc = pytest.mark.skipif(library.compiler() is None, reason="no C compiler")


def c_members(sources: list[Path], struct: str) -> list[str]:
    """The member names of C's `typedef struct { ... } struct;` in `sources`, in order."""
    for path in sources:
        text = re.sub(r"/\*.*?\*/|//[^\n]*", "", path.read_text(), flags=re.S)
        m = re.search(r"typedef struct\s*\{([^{}]*)\}\s*" + struct + r"\s*;", text)
        if m is None:
            continue
        names = []
        for decl in filter(None, (d.strip() for d in m.group(1).split(";"))):
            pointer_to_fn = re.search(r"\(\s*\*\s*(\w+)\s*\)", decl)
            if pointer_to_fn:
                names.append(pointer_to_fn.group(1))
                continue
            decl = re.sub(r"\[[^\]]*\]", "", decl)
            names += [re.findall(r"\w+", part)[-1] for part in decl.split(",")]
        return names
    raise AssertionError(f"no typedef struct {struct} in {[p.name for p in sources]}")


def sources(src_dir: Path) -> list[Path]:
    return sorted([*src_dir.glob("*.c"), *src_dir.glob("*.h")])


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("abi")


@needs_cc
@pytest.mark.parametrize("name", sorted(LIBS))
def test_every_mirrored_struct_is_the_one_the_library_reports(name, cache) -> None:
    path = library.build(name, cache, src_dir=SRC_DIRS.get(name))
    assert path is not None
    reported = abi.reported(ctypes.CDLL(str(path)))
    assert sorted(reported) == sorted(s.__name__ for s in LIBS[name])  # none on one side only
    assert abi.mismatches(reported, LIBS[name]) == []


@needs_cc
@pytest.mark.parametrize(("name", "struct"), PAIRS)
def test_the_library_reports_every_member_of_the_c_struct(name, struct, cache) -> None:
    """The C table (abi.h) is written by hand: a member it leaves out would go unseen
    where it fits in padding, so the struct's own definition is read here."""
    src = sources(SRC_DIRS.get(name, library.SRC_DIR))
    path = library.build(name, cache, src_dir=SRC_DIRS.get(name))
    assert path is not None
    reported = abi.reported(ctypes.CDLL(str(path)))[struct]
    assert c_members(src, struct) == [f for f in reported if f]


def test_the_struct_reader_reads_each_kind_of_member() -> None:
    assert library.SRC_DIR in (p.parent for p in sources(library.SRC_DIR))
    got = c_members(sources(zmq_native.SRC_DIR), "ZmqApi")  # pointers to functions
    assert got == [name for name, *_ in zmq_native.ZmqApi._fields_]
    got = c_members(sources(library.SRC_DIR), "DecodeLayer")  # several per line, structs
    assert got[:4] == ["input_norm", "post_norm", "pre_ff_norm", "post_ff_norm"]
    assert got[6:10] == ["cos", "sin", "qkv", "o"]
    assert "bounds" in c_members(sources(library.SRC_DIR), "DecodePlan")  # an array


@needs_cc
def test_a_field_declared_in_python_only_refuses_the_load(cache, monkeypatch) -> None:
    class LinearArgs(ctypes.Structure):
        _fields_ = [*abi.LinearArgs._fields_, ("extra", ctypes.c_int64)]

    monkeypatch.setattr(library, "_loaded", {})
    with pytest.raises(AbiMismatch, match=r"LinearArgs\.extra: declared in Python only"):
        library.load("linear_f32", cache, structs=(LinearArgs,))
    assert "linear_f32" not in library._loaded


def _sources_with(tmp_path: Path, monkeypatch, edits: dict[str, tuple[str, str]]) -> None:
    """This package's C sources copied and edited (file -> (old, new)), built from there."""
    src = tmp_path / "src"
    shutil.copytree(library.SRC_DIR, src, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    for name, (old, new) in edits.items():
        text = (src / name).read_text()
        assert old in text, (name, old)
        (src / name).write_text(text.replace(old, new, 1))
    monkeypatch.setattr(library, "SRC_DIR", src)
    monkeypatch.setattr(library, "_loaded", {})


@needs_cc
def test_a_field_added_in_c_only_refuses_the_load(tmp_path, monkeypatch) -> None:
    _sources_with(
        tmp_path,
        monkeypatch,
        {
            "kernel_args.h": ("int64_t m, n, k_dim;", "int64_t m, n, k_dim, extra;"),
            "linear_f32.c": ("PD_ABI_FIELD(LinearArgs, x),", "PD_ABI_FIELD(LinearArgs, extra),"),
        },
    )
    with pytest.raises(AbiMismatch, match=r"LinearArgs\.extra: in the C struct only"):
        library.load("linear_f32", tmp_path)


@needs_cc
def test_a_field_moved_in_c_refuses_the_load_naming_it(tmp_path, monkeypatch) -> None:
    _sources_with(tmp_path, monkeypatch, {"page_copy.c": ("int64_t block;", "int32_t block;")})
    with pytest.raises(
        AbiMismatch,
        match=r"PageRuns\.block: \(offset, size\) \(112, 8\) in Python, \(112, 4\) in C",
    ):
        library.load("page_copy", tmp_path)


@needs_cc
def test_a_c_field_missing_from_the_table_is_caught(tmp_path, monkeypatch) -> None:
    """Added to the struct but not to its table: where it changes the struct's size the
    load refuses; where it fits in padding only reading the struct finds it."""
    _sources_with(
        tmp_path,
        monkeypatch,
        {
            "kernel_args.h": (
                "int32_t status;\n} PagedDecodeArgs;",
                "int32_t status, extra;\n} PagedDecodeArgs;",
            )
        },
    )
    path = library.build("paged_decode", tmp_path)
    assert path is not None
    reported = abi.reported(ctypes.CDLL(str(path)))["PagedDecodeArgs"]
    members = c_members(sources(tmp_path / "src"), "PagedDecodeArgs")
    assert set(members) - set(reported) == {"extra"}
