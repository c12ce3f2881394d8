"""An idle daemon and the operator's commands load no torch (and no scipy): the daemon imports
the stage's code when it builds a stage, and measures its speed figures in a child process whose
figures it keeps in its data dir (peer/speed.py, docs/daemon.md "Memory")."""

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import polling
import pytest

from dtfm.peer.config import SocketConfig
from dtfm.peer.control_client import ControlClient, ControlClientError, DaemonNotRunning

# What the daemon (`join`), the control plane, gossip, the swarm tool and the CLI's signing import
# before any stage exists, each name resolved as its users resolve it; then which heavy modules
# got loaded. A fresh interpreter: this test process has torch already.
IMPORTS = r"""
import sys
import dtfm.gossip, dtfm.control, dtfm.peer.services, dtfm.peer.runner, dtfm.peer.cli, dtfm.swarm.cli
from dtfm.control import ControlPlane, SignedOp, TrainError, TrainRequest, sign_op, council_arg
from dtfm.control import Allocation, SignedAllocation, PlaneConfig, RunEnd, StepReport
from dtfm.control.dataplane import TensorRouter
from dtfm.control.epoch.recovery import RecoveryServer
from dtfm.gossip import GossipService
from dtfm.peer.runner import run_daemon
from dtfm.train import Plan, GPTSpec, TrainConfig, CommError, check_compression, split_batch, Corpus, load_corpus
print(" ".join(m for m in ("torch", "scipy", "safetensors") if m in sys.modules))
"""

DEADLINE_S = 60.0
FAST = """
[discovery]
retry_initial_s = 0.05
retry_max_s = 0.5

[plane]
profile = "test"
"""


def test_the_daemon_control_plane_gossip_and_signing_import_no_torch_or_scipy():
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# What the operator's reading commands load, up to asking the daemon (none runs here: each ends
# with "no daemon is running"): the control client, not the daemon's event loop or numpy.
READING = r"""
import sys
from dtfm.peer.cli import main
for args in (["status"], ["status", "--json"], ["members"], ["train", "status"]):
    try:
        main([*args, "--data-dir", sys.argv[1]])
    except SystemExit:
        pass
print(" ".join(m for m in ("trio", "numpy", "scipy", "torch") if m in sys.modules))
"""


def test_the_reading_commands_load_neither_trio_nor_numpy(tmp_path):
    out = subprocess.run([sys.executable, "-c", READING, str(tmp_path / "p")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("no daemon is running") == 4, out.stderr
    assert out.stdout.strip() == ""


def cli(*args, probe=False):
    """`dtfm-peer ARGS` in a fresh interpreter; with `probe`, its last stderr line says whether
    it loaded torch."""
    code = ("import sys\nfrom dtfm.peer.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\nsys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=DEADLINE_S)


class Daemon:
    def __init__(self, root: Path, *extra: str):
        self.data_dir = root / "p"
        self.log_path = root / "p.log"
        self.log = open(self.log_path, "a")
        args = [sys.executable, "-m", "dtfm.peer", "join", "--config", root / "fast.toml", "--data-dir", self.data_dir,
                "--swarm-key", root / "swarm.key", "--listen", "127.0.0.1:0", *extra]
        self.proc = subprocess.Popen([str(a) for a in args], stdout=self.log, stderr=subprocess.STDOUT)

    def status(self):
        try:
            with ControlClient(self.data_dir / "control" / "peer.sock", SocketConfig(request_timeout_s=5.0)) as c:
                return c.request("status")
        except (DaemonNotRunning, ControlClientError):
            return None

    def loaded(self, package: str) -> bool:
        """Whether the daemon's memory maps a file of site-packages/`package`/ (its extension modules)."""
        return f"/{package}/" in Path(f"/proc/{self.proc.pid}/maps").read_text()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(prefix="dtfm-light-", dir="/tmp"))  # (a short control socket path)
    (path / "fast.toml").write_text(FAST)
    assert cli("swarm-key", "new", "--out", path / "swarm.key").returncode == 0
    daemons: list[Daemon] = []
    try:
        yield path, daemons
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_an_idle_daemon_measures_its_speed_in_a_child_keeps_it_and_loads_no_torch(root):
    path, daemons = root
    # First start: no figure given, none kept: a child measures both and the daemon keeps them.
    first = Daemon(path)
    daemons.append(first)
    speed = first.data_dir / "speed.json"
    polling.wait_for("the child's figures in speed.json", lambda: speed.exists(), 110, interval_s=0.1)
    kept = json.loads(speed.read_text())
    assert kept["compute_ms"] > 0 and len(kept["codec_ns"]) == 7
    assert polling.wait_for("status", first.status, DEADLINE_S, interval_s=0.05)
    assert not first.loaded("torch") and not first.loaded("scipy")
    # The operator's brake and status answer without torch in the CLI (no run: refused with the reason).
    stop = cli("train", "stop", "--data-dir", first.data_dir)
    assert stop.returncode != 0 and "no training run" in stop.stderr and "no torch" in stop.stderr.splitlines()[-1]
    status = cli("status", "--data-dir", first.data_dir)
    assert status.returncode == 0 and status.stderr.splitlines()[-1] == "no torch"
    assert not first.loaded("torch")
    first.stop()
    daemons.remove(first)
    log = first.log_path.read_text()
    assert "speed figures: measured by a child process" in log

    # Restart: the kept figures, no child; the same with a figure given.
    again = Daemon(path)
    daemons.append(again)
    assert polling.wait_for("status", again.status, DEADLINE_S, interval_s=0.05)
    polling.wait_for("the start's log line", lambda: "as measured before" in first.log_path.read_text(),
                     DEADLINE_S, interval_s=0.05)
    assert json.loads(speed.read_text()) == kept and not again.loaded("torch")
