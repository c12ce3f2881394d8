"""The run directory of a scripted test swarm: which peer processes run where.

    RUN_DIR/
        swarm.json        this state, rewritten atomically (temp file + rename)
        swarm.key         the swarm key every peer of the swarm uses
        p00/ p01/ ...     each peer's data dir (identity, control socket, daemon.log)

Every `dtfm-swarm` subcommand reads and writes this file, so the commands work from any shell.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "swarm.json"
KEY_FILE = "swarm.key"
STATE_VERSION = 1


class SwarmError(Exception):
    """A swarm command that cannot go on; str() says why and what to do."""


def default_run_dir() -> Path:
    """Short, per-user and writable: Unix socket paths inside it must stay under 104 bytes."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and len(runtime) < 40 and os.access(runtime, os.W_OK):
        return Path(runtime) / "dtfm-swarm"
    return Path(tempfile.gettempdir()) / f"dtfm-swarm-{os.getuid()}"


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
        return Path(self.data_dir) / "daemon.log"

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
    path = run_dir / STATE_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise SwarmError(f"no swarm in {run_dir}: start one with `dtfm-swarm up` "
                         f"(or pass the --run-dir it was started with)") from None
    except (OSError, ValueError) as e:
        raise SwarmError(f"cannot read swarm state {path}: {e}") from None
    if raw.get("version") != STATE_VERSION:
        raise SwarmError(f"{path} was written by another version of dtfm-swarm: "
                         f"remove {run_dir} and start again")
    peers = [PeerEntry(**p) for p in raw.pop("peers")]
    return SwarmState(peers=peers, **raw)


def save_state(run_dir: Path, state: SwarmState) -> None:
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = json.dumps(asdict(state), indent=2)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".swarm.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, run_dir / STATE_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
