"""The folder of built native libraries, kept so that no other local user can put code
into this process.

A library loaded from the cache runs with the server's rights. The cache lives under
PDSERVE_CACHE_DIR, which a deployment may point anywhere (a shared volume, /tmp), so:

- the folder `<cache>/native` is made 0700, and used only when it is a real folder (not
  a link) that this user owns (its mode is then set to 0700 again);
- a library is loaded only when it is a regular file that this user owns and that
  neither group nor others may write; one that is not is built again, into a fresh
  file that replaces it. The check is made on the open file that is then loaded
  (`open_library`), so the file checked is the file loaded;
- a build's temporary file (`tmp*.so`) left by a killed build is removed once it is
  older than any build takes (STALE_S).
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import time
from pathlib import Path

log = logging.getLogger(__name__)

STALE_S = 600.0  # a temporary file this old belongs to no build still running


def unsafe(st: os.stat_result) -> str | None:
    """Why a file or folder with this status could hold another user's code (None: it
    cannot): not this user's, or writable by group or others."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this user's ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {stat.filemode(st.st_mode)}: writable by group or others"
    return None


def private_dir(path: Path) -> bool:
    """Makes `path` (0700) or checks it; False, with an error logged, where it is not a
    folder of this user's."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    reason = "not a folder" if not stat.S_ISDIR(st.st_mode) else None
    if reason is None and st.st_uid != os.geteuid():
        reason = f"owned by uid {st.st_uid}, not this user's ({os.geteuid()})"
    if reason is not None:
        log.error(
            "native kernel cache %s not used (%s): set PDSERVE_CACHE_DIR to a folder of"
            " this user's; native kernels are off",
            path,
            reason,
        )
        return False
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # NOTE: an older pdserve made it with the default mode
    return True


def usable(path: Path) -> bool:
    """Whether `path` is a library to load as it is (False: absent, or to be built
    again; the reason is logged)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    reason = "not a regular file" if not stat.S_ISREG(st.st_mode) else unsafe(st)
    if reason is not None:
        log.warning("native library %s not loaded (%s): building it again", path, reason)
    return reason is None


def clean_stale(folder: Path) -> None:
    """Removes this user's temporary build files older than STALE_S (a killed build's)."""
    now = time.time()
    for p in folder.glob("tmp*.so"):
        try:
            st = os.lstat(p)
            if st.st_uid == os.geteuid() and now - st.st_mtime > STALE_S:
                p.unlink()
        except OSError:  # NOTE: another engine cleaned it first
            continue


def open_library(path: Path) -> ctypes.CDLL | None:
    """The library at `path`, loaded from the very file checked here (through its open
    descriptor, where /proc is); None, with an error logged, where that file is not
    safe to load (usable() said yes, and someone changed it since)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        reason = "not a regular file" if not stat.S_ISREG(st.st_mode) else unsafe(st)
        if reason is not None:
            log.error("native library %s refused (%s)", path, reason)
            return None
        by_fd = f"/proc/self/fd/{fd}"
        if not os.path.exists(by_fd):
            return ctypes.CDLL(str(path))
        lib = ctypes.CDLL(by_fd)
    except BaseException:
        os.close(fd)
        raise
    # NOTE: the descriptor stays open for the life of the process: the loader knows a
    # library by the name it was opened by, and a closed descriptor's number (its name
    # here) would be handed to the next library and resolve to this one
    _held.append(fd)
    return lib


_held: list[int] = []  # descriptors of the libraries loaded through /proc (open_library)
