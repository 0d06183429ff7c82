"""The native kernel cache keeps other local users' code out of the server
(kernels/native/cache.py): its folder is private, a library in it is loaded only when
this user owns it and no one else may write it, and a killed build's files go."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import time

import pytest

from pdserve.kernels.native import cache, library

pytestmark = pytest.mark.skipif(library.compiler() is None, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch):
    """No library loaded yet in this process, and a umask that lets group and others
    read (the common default), so a private mode is the code's doing."""
    monkeypatch.setattr(library, "_loaded", {})
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_cache_folder_is_made_private(tmp_path, fresh) -> None:
    path = library.build("par", tmp_path)
    assert path is not None
    assert _mode(tmp_path / "native") == 0o700
    assert _mode(path) & 0o077 == 0


def test_an_open_cache_folder_of_ours_is_closed(tmp_path, fresh) -> None:
    (tmp_path / "native").mkdir(mode=0o777)
    os.chmod(tmp_path / "native", 0o777)
    assert library.load("par", tmp_path) is not None
    assert _mode(tmp_path / "native") == 0o700


def test_a_cache_folder_of_another_user_is_not_used(tmp_path, fresh, monkeypatch, caplog) -> None:
    (tmp_path / "native").mkdir()
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    caplog.set_level(logging.ERROR)
    assert library.load("par", tmp_path) is None
    assert "not used" in caplog.text and f"owned by uid {me}" in caplog.text
    assert list((tmp_path / "native").iterdir()) == []  # nothing built there either


def _plant(tmp_path, name: str, mode: int) -> object:
    """Another library's file put where `name`'s build goes, with `mode`."""
    path = library.build(name, tmp_path)
    other = library.build("par", tmp_path)
    assert path is not None and other is not None
    path.unlink()
    shutil.copyfile(other, path)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o775, 0o757], ids=["group", "others"])
def test_a_library_others_may_write_is_built_again(tmp_path, fresh, mode, caplog) -> None:
    path = _plant(tmp_path, "page_copy", mode)
    caplog.set_level(logging.WARNING)
    lib = library.load("page_copy", tmp_path)
    assert lib is not None and hasattr(lib, "pd_page_scatter_layers")  # not the planted file
    assert "writable by group or others" in caplog.text
    assert _mode(path) & 0o022 == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")
def test_a_library_of_another_user_is_built_again(tmp_path, fresh, caplog) -> None:
    path = _plant(tmp_path, "page_copy", 0o755)
    os.chown(path, 65534, 65534)
    caplog.set_level(logging.WARNING)
    lib = library.load("page_copy", tmp_path)
    assert lib is not None and hasattr(lib, "pd_page_scatter_layers")
    assert "owned by uid 65534" in caplog.text and os.lstat(path).st_uid == 0


def test_a_link_in_place_of_a_library_is_built_again(tmp_path, fresh) -> None:
    path = library.build("page_copy", tmp_path)
    other = library.build("par", tmp_path)
    assert path is not None and other is not None
    path.unlink()
    path.symlink_to(other)
    lib = library.load("page_copy", tmp_path)
    assert lib is not None and hasattr(lib, "pd_page_scatter_layers")
    assert not path.is_symlink()


def test_a_library_changed_after_its_check_is_refused(tmp_path, fresh, caplog) -> None:
    """The file loaded is the file checked: one made writable between the two is not."""
    path = library.build("par", tmp_path)
    assert path is not None
    os.chmod(path, 0o777)
    caplog.set_level(logging.ERROR)
    assert cache.open_library(path) is None
    assert "refused" in caplog.text
    os.chmod(path, 0o700)
    assert isinstance(cache.open_library(path), ctypes.CDLL)


def test_a_killed_builds_temporary_files_are_removed(tmp_path, fresh) -> None:
    folder = tmp_path / "native"
    folder.mkdir(mode=0o700)
    stale, running = folder / "tmpkilled.so", folder / "tmprunning.so"
    stale.write_bytes(b"half a library")
    running.write_bytes(b"a build in progress")
    old = time.time() - cache.STALE_S - 60
    os.utime(stale, (old, old))
    assert library.build("par", tmp_path) is not None
    assert not stale.exists() and running.exists()
