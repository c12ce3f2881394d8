"""Files replaced whole: `atomic_write(path, data)` and `atomic_file(path)`.

The new contents go to a temporary file in the same folder (so that the rename cannot cross
file systems), which is flushed, fsynced and renamed over `path` with `os.replace`: a reader,
or the next start after a crash, sees the old file or the new one, never a mix. When anything
fails or is interrupted before the rename (a full disk, an exception in the caller's writing,
Ctrl-C, a cancelled task), the temporary file is removed and `path` is left as it was.

The temporary file's name holds the writer's process id, so that writers in several processes
never share one; one left behind by a process that died while writing is removed by the next
write of the same path.

`replace=False` links the new file into place instead, which fails with FileExistsError when
`path` exists: a file made once (a key) is never overwritten by a second writer. `sync_dir`
also fsyncs the folder after the rename, so that the rename itself survives a power loss.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "atomic_write", "fsync_dir"]

Bytes = bytes | bytearray | memoryview


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder, so that the names created or renamed in it last."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike[str], *, mode: int | None = None, replace: bool = True,
                sync_dir: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write that becomes `path` when the block ends without an exception.

    mode: the new file's permissions, whatever the umask (0o600 for a secret); None: 0o666
    less the umask, as `open()` makes a file."""
    path = Path(path)
    _sweep(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o666 if mode is None else mode)
    try:
        with open(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            yield f
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def _sweep(path: Path) -> None:
    """Remove the temporary files of `path` whose writer process is gone (killed mid-write)."""
    prefix = f".{path.name}."
    try:
        names = [e.name for e in os.scandir(path.parent) if e.name.startswith(prefix) and e.name.endswith(".tmp")]
    except OSError:
        return  # no folder: os.open says so next
    for name in names:
        pid = name[len(prefix):-len(".tmp")].partition(".")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(path.parent / name)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def atomic_write(path: str | os.PathLike[str], data: Bytes | str | Iterable[Bytes], *,
                 mode: int | None = None, replace: bool = True, sync_dir: bool = False) -> None:
    """Replace `path` with `data` (a str is written as UTF-8; an iterable's parts are written in
    turn, each made when it is written): see `atomic_file` for the options."""
    with atomic_file(path, mode=mode, replace=replace, sync_dir=sync_dir) as f:
        if isinstance(data, str):
            f.write(data.encode())
        elif isinstance(data, (bytes, bytearray, memoryview)):
            f.write(data)
        else:
            for part in data:
                f.write(part)
