"""The run directory of a scripted test swarm: which peer processes run where.

    RUN_DIR/              mode 0700, owned by the user running dtfm-swarm
        swarm.json        this state, rewritten atomically (temp file + rename)
        swarm.key         the swarm key every peer of the swarm uses (mode 0600)
        p00/ p01/ ...     each peer's data dir (identity, control socket, daemon.log)

Every `dtfm-swarm` subcommand reads and writes this file, so the commands work from any shell.

The run dir holds a secret (the swarm key) and PIDs that `down` and `kill` signal, so it is
taken only as this user's own: `ensure_run_dir` creates it (mode 0700) or refuses an existing
one that another user owns, that others may enter, or that is a symbolic link, and
`load_state` refuses to read state from such a dir. Secrets are written by `write_secret_file`,
which never writes through a file or a link that is already there. The default place is per
user (`$XDG_RUNTIME_DIR/dtfm-swarm`, else `~/.cache/dtfm/swarm`), never a guessable name in
the shared temporary directory.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dtfm.files import atomic_write

STATE_FILE = "swarm.json"
KEY_FILE = "swarm.key"
STATE_VERSION = 1


class SwarmError(Exception):
    """A swarm command that cannot go on; str() says why and what to do; `code`, the kind of a
    daemon's refusal where it named one (peer/socket.py)."""

    def __init__(self, reason: str, *, code: str | None = None) -> None:
        super().__init__(reason)
        self.code = code


def default_run_dir() -> Path:
    """Per user: `$XDG_RUNTIME_DIR/dtfm-swarm` (a private directory the login session owns)
    when it is set, absolute, short (Unix socket paths inside the run dir must stay under 104
    bytes) and writable; else `~/.cache/dtfm/swarm`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and len(runtime) < 40 and os.access(runtime, os.W_OK):
        return Path(runtime) / "dtfm-swarm"
    return Path.home() / ".cache" / "dtfm" / "swarm"


def check_run_dir(run_dir: Path) -> None:
    """Refuse an existing run dir that is not this user's own and private: a symbolic link,
    not a directory, owned by another user, or open to group or others (mode & 0o077).
    FileNotFoundError when there is none."""
    st = os.lstat(run_dir)
    if stat.S_ISLNK(st.st_mode):
        raise SwarmError(f"run dir {run_dir} is a symbolic link: pass the directory itself with "
                         f"--run-dir, or remove the link")
    if not stat.S_ISDIR(st.st_mode):
        raise SwarmError(f"run dir {run_dir} exists and is not a directory: remove it or pass "
                         f"another --run-dir")
    if st.st_uid != os.getuid():
        raise SwarmError(f"run dir {run_dir} belongs to another user (uid {st.st_uid}), who could "
                         f"read the swarm key or swap the peers' PIDs: pass a --run-dir of your own")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SwarmError(f"run dir {run_dir} has mode {mode:04o}: other users can enter it; "
                         f"`chmod 700 {run_dir}` if you made it, or remove it and start again")


def ensure_run_dir(run_dir: Path) -> None:
    """Create run_dir with mode 0700 (its parents as usual), or check that the one already
    there is this user's own and private (`check_run_dir`); SwarmError otherwise."""
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(run_dir, 0o700)  # never exist_ok: a directory already there is checked
    except FileExistsError:
        check_run_dir(run_dir)
        return
    except OSError as e:
        raise SwarmError(f"cannot create run dir {run_dir}: {e.strerror or e}") from None
    os.chmod(run_dir, 0o700)  # whatever the umask


def write_secret_file(path: Path, data: bytes) -> None:
    """Write data to a new file at path readable by this user only (mode 0600). Whatever is
    at path (a stale file, a planted file or symbolic link) is removed first and never written
    through: the file is created with O_EXCL | O_NOFOLLOW. The directory must be this user's
    own and private (`ensure_run_dir`), or another user could plant a file again in between."""
    try:
        os.unlink(path)  # a symbolic link itself, not what it points to
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class PeerEntry:
    name: str  # p00, p01, ...
    index: int  # position in the scenario's peer order
    region: str
    port: int
    data_dir: str
    pid: int | None = None
    peer_id: str = ""  # hex, learned from the daemon once it answers

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        """The daemon's log (`join --log-file`: rotated by size, daemon.log.1 the newest before it)."""
        return Path(self.data_dir) / "daemon.log"

    @property
    def out_file(self) -> Path:
        """What the daemon's process prints outside its log: an interpreter's crash, a C library's warning."""
        return Path(self.data_dir) / "daemon.out"

    def alive(self) -> bool:
        return self.pid is not None and pid_alive(self.pid)


@dataclass
class SwarmState:
    scenario: str  # built-in name or path to the scenario file
    scenario_name: str
    time_scale: float
    bandwidth_scale: float
    peers: list[PeerEntry] = field(default_factory=list)
    emulated: bool = True  # False: plain loopback, the scenario only names the regions
    plane_profile: str = "test"  # the peers' control plane profile (`up --plane-profile`)
    model_dirs: list[str] = field(default_factory=list)  # every peer's `join --model-dir` (`up --model-dir`)
    device: str = "cpu"  # every peer's `join --device` (`up --device`): their stages' torch device
    # This machine's compute figure (gossip's reference block, ms), every peer's from its start
    # (`up --compute-ms`, else measured at `up`); 0: none (a state from before: proc.NOMINAL_COMPUTE_MS)
    compute_ms: float = 0.0
    # every peer's `join --layer-probe` (`up --layer-probe`): measure, or off (layers costed at
    # the reference rate from `compute_ms`, no probe at a start)
    layer_probe: str = "measure"
    # every peer's `join --pipeline-schedule` (`up --pipeline-schedule`): fitted, or gpipe
    pipeline_schedule: str = "fitted"
    version: int = STATE_VERSION

    def find(self, ref: str) -> PeerEntry:
        """A peer by name (p03), index (3) or peer-id prefix (at least 4 hex digits)."""
        for p in self.peers:
            if ref == p.name:
                return p
        if ref.isdigit():
            idx = int(ref)
            for p in self.peers:
                if p.index == idx:
                    return p
        ref_l = ref.lower()
        if len(ref_l) >= 4:
            hits = [p for p in self.peers if p.peer_id and p.peer_id.startswith(ref_l)]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                raise SwarmError(f"peer id prefix {ref!r} matches {len(hits)} peers: give more digits")
        names = ", ".join(p.name for p in self.peers[:4])
        raise SwarmError(f"no peer {ref!r} in this swarm: use a name ({names}, ...), an index, "
                         f"or a peer-id prefix from `dtfm-swarm status`")


def load_state(run_dir: Path) -> SwarmState:
    """The state in run_dir, which must be this user's own and private (`check_run_dir`)."""
    path = run_dir / STATE_FILE
    try:
        check_run_dir(run_dir)
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise SwarmError(f"no swarm in {run_dir}: start one with `dtfm-swarm up` "
                         f"(or pass the --run-dir it was started with)") from None
    except (OSError, ValueError) as e:
        raise SwarmError(f"cannot read swarm state {path}: {e}") from None
    if raw.get("version") != STATE_VERSION:
        raise SwarmError(f"{path} was written by another version of dtfm-swarm: "
                         f"remove {run_dir} and start again")
    try:
        peers = [PeerEntry(**p) for p in raw.pop("peers")]
        return SwarmState(peers=peers, **raw)
    except (TypeError, AttributeError, KeyError):  # (a field this version does not know, or a damaged file)
        raise SwarmError(f"{path} was written by another version of dtfm-swarm: "
                         f"remove {run_dir} and start again") from None


def save_state(run_dir: Path, state: SwarmState) -> None:
    ensure_run_dir(run_dir)
    atomic_write(run_dir / STATE_FILE, json.dumps(asdict(state), indent=2), mode=0o600)


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def send_signal(pid: int, sig: int = signal.SIGTERM) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
