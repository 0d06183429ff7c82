"""A folder made once, on first use, by whichever process asks first: the cached models
(make.default_model_path), GGUF conversions (resolve.py), assembled model wheels
(wheels.py). Safe across processes: the maker holds an flock, builds in a temp
folder beside the target and renames it into place, so a visible folder is always
complete."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """`target`, made by `build(folder)` on first use; safe across processes.

    The maker holds an flock, builds in a temp folder beside the target and renames
    it into place, so a visible folder is always complete.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if target.is_dir():  # another process made it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
