"""Files replaced whole (dtfm/files.py): the new contents or the old, never a mix, never a
temporary file left behind, whatever stops the write."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from dtfm import files
from dtfm.files import atomic_file, atomic_write


def _names(d) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_bytes_text_and_parts_replace_the_file(tmp_path):
    path = tmp_path / "f"
    atomic_write(path, b"one")
    assert path.read_bytes() == b"one"
    atomic_write(path, "twö")
    assert path.read_bytes() == "twö".encode()
    atomic_write(path, (part for part in (b"a", bytearray(b"b"), memoryview(b"cd")[1:])))
    assert path.read_bytes() == b"abd"
    assert _names(tmp_path) == ["f"]


def test_an_error_while_writing_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f"
    atomic_write(path, b"old")

    def parts():
        yield b"half of the new"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(path, parts())
    with pytest.raises(KeyboardInterrupt):  # an interrupt (or a cancelled task) too
        with atomic_file(path) as f:
            f.write(b"new")
            raise KeyboardInterrupt
    assert path.read_bytes() == b"old"
    assert _names(tmp_path) == ["f"]


def test_a_failed_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "f"
    atomic_write(path, b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert _names(tmp_path) == ["f"]


def test_the_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(files.os, "fsync", lambda fd: (calls.append(("fsync", stat.S_ISDIR(os.fstat(fd).st_mode))),
                                                       real_fsync(fd))[1])
    monkeypatch.setattr(files.os, "replace", lambda a, b: (calls.append(("replace", str(b))), real_replace(a, b))[1])
    atomic_write(tmp_path / "f", b"x")
    assert calls == [("fsync", False), ("replace", str(tmp_path / "f"))]
    calls.clear()
    atomic_write(tmp_path / "f", b"y", sync_dir=True)
    assert calls == [("fsync", False), ("replace", str(tmp_path / "f")), ("fsync", True)]


def test_mode_is_exact_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "secret", b"k", mode=0o600)
        atomic_write(tmp_path / "shared", b"w", mode=0o644)
        atomic_write(tmp_path / "plain", b"p")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "shared").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "plain").st_mode) == 0o600  # 0o666 less the umask


def test_without_replace_an_existing_file_is_never_overwritten(tmp_path):
    path = tmp_path / "key"
    atomic_write(path, b"first", replace=False)
    with pytest.raises(FileExistsError):
        atomic_write(path, b"second", replace=False)
    assert path.read_bytes() == b"first"
    assert _names(tmp_path) == ["key"]


def test_a_link_at_the_path_is_replaced_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"untouched")
    path = tmp_path / "f"
    path.symlink_to(target)
    atomic_write(path, b"new")
    assert not path.is_symlink() and path.read_bytes() == b"new"
    assert target.read_bytes() == b"untouched"


def test_a_temporary_file_of_a_dead_writer_goes_at_the_next_write(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    path = tmp_path / "f"
    left = tmp_path / f".f.{dead.pid}.0badcafe.tmp"  # killed while writing
    left.write_bytes(b"half")
    live = tmp_path / f".f.{os.getpid()}.0badcafe.tmp"  # a writer still at work
    live.write_bytes(b"busy")
    other = tmp_path / f".g.{dead.pid}.0badcafe.tmp"  # another file's
    other.write_bytes(b"half")
    atomic_write(path, b"new")
    assert _names(tmp_path) == sorted(["f", live.name, other.name])
