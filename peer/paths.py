"""Where a peer keeps its files: the data directory and the control socket inside it.

    DATA_DIR/                 0700, created by the daemon or `dtfm-peer keygen`
        identity.key          the Ed25519 identity (dtfm.net.identity), 0600
        daemon.lock           held (flock) by the running daemon; one daemon per data dir
        control/              0700
            peer.sock         the control socket, 0600
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "DTFM_DATA_DIR"  # the data dir when no flag or config file names one
CONTROL_DIR_NAME = "control"
CONTROL_SOCKET_NAME = "peer.sock"
LOCK_FILE_NAME = "daemon.lock"
# sun_path holds 108 bytes on Linux (104 on BSDs), including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 103


class DataDirError(Exception):
    """The data directory cannot be used; str() says why and what to do."""


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The data dir when neither --data-dir nor a config file names one: $DTFM_DATA_DIR (so
    that several daemons on one host each get theirs in a shell), else $XDG_DATA_HOME/dtfm,
    else ~/.local/share/dtfm when XDG_DATA_HOME is unset or relative."""
    env = os.environ if environ is None else environ
    own = env.get(DATA_DIR_ENV, "")
    if own:
        return Path(own)
    xdg = env.get("XDG_DATA_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "dtfm"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "share" / "dtfm"


@dataclass(frozen=True)
class DataDir:
    root: Path

    @property
    def control_dir(self) -> Path:
        return self.root / CONTROL_DIR_NAME

    @property
    def control_socket(self) -> Path:
        return self.control_dir / CONTROL_SOCKET_NAME

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_FILE_NAME

    def ensure(self) -> None:
        """Create the data and control directories with mode 0700, or fix a looser mode."""
        for d in (self.root, self.control_dir):
            try:
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                st = d.stat()
            except OSError as e:
                raise DataDirError(f"cannot create data dir {d}: {e.strerror}") from None
            if not stat.S_ISDIR(st.st_mode):
                raise DataDirError(f"{d} exists and is not a directory")
            if st.st_uid != os.getuid():
                raise DataDirError(f"{d} belongs to another user (uid {st.st_uid}); "
                                   f"pick your own with --data-dir")
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(d, 0o700)

    def check_socket_path(self) -> None:
        n = len(os.fsencode(self.control_socket))
        if n > MAX_SOCKET_PATH_BYTES:
            raise DataDirError(
                f"control socket path {self.control_socket} is {n} bytes, longer than the "
                f"{MAX_SOCKET_PATH_BYTES} a Unix socket allows: use a shorter --data-dir")


class DataDirLock:
    """An exclusive flock on DATA_DIR/daemon.lock, held for the daemon's lifetime, so two
    daemons never share a data dir (and a leftover socket file is known to be stale)."""

    def __init__(self, data_dir: DataDir):
        self.data_dir = data_dir
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        path = self.data_dir.lock_file
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise DataDirError(
                f"a daemon is already running for data dir {self.data_dir.root} (pid {pid}): "
                f"stop it with `dtfm-peer leave --data-dir {self.data_dir.root}` or pick "
                f"another --data-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd = fd

    def in_use(self) -> bool:
        """Whether a daemon holds the lock now (a daemon that has left releases it on its way
        out); this object's own lock does not count."""
        import fcntl

        try:
            fd = os.open(self.data_dir.lock_file, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # (closing releases the probe's shared lock)
        return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DataDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
