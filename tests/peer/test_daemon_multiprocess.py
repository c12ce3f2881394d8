"""Real `dtfm-peer join` processes on loopback: discovery, status, leave, SIGTERM, wrong key.

Every process is stopped and every directory removed when a test ends, passed or failed.
Waits poll the daemons' control sockets or logs up to a deadline; nothing asserts on timing.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import polling
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dtfm.peer.config import SocketConfig
from dtfm.peer.control_client import ControlClient, ControlClientError, DaemonNotRunning
from dtfm.peer.paths import DataDir, DataDirLock

pytestmark = pytest.mark.slow

DEADLINE_S = 30.0
FAST = """
[discovery]
retry_initial_s = 0.05
retry_max_s = 0.5
exchange_interval_s = 0.5
leave_timeout_s = 2.0

[plane]
profile = "test"
"""


# Every daemon reports one compute and coding figure and probes no layer: each probe costs a
# start seconds of a shared CPU in a child that imports torch, and the daemons measuring
# themselves are tests/peer/test_light_daemon.py's and tests/peer/test_speed.py's.
FIXED_SPEEDS = ("--compute-ms", "30", "--codec-speed", "reference", "--layer-probe", "off")


def cli(*args, env=None, timeout=DEADLINE_S):
    return subprocess.run([sys.executable, "-m", "dtfm.peer", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def wait_for(what, condition, deadline_s=DEADLINE_S):
    return polling.wait_for(what, condition, deadline_s, interval_s=0.05)


class Peer:
    def __init__(self, root: Path, name: str, key: Path, bootstrap=(), extra=()):
        self.name = name
        self.data_dir = root / name
        self.log_path = root / f"{name}.log"
        args = [sys.executable, "-m", "dtfm.peer", "join", "--config", root / "fast.toml",
                "--data-dir", self.data_dir, "--swarm-key", key, "--listen", "127.0.0.1:0",
                "--region", f"r-{name}", *FIXED_SPEEDS, *extra]
        for b in bootstrap:
            args += ["--bootstrap", b]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(a) for a in args], stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def request(self, op):
        """The daemon's answer to `op`, or None while it is not (yet) answering."""
        sock = self.data_dir / "control" / "peer.sock"
        try:
            with ControlClient(sock, SocketConfig(request_timeout_s=5.0)) as c:
                return c.request(op)
        except (DaemonNotRunning, ControlClientError):
            return None

    def status(self):
        return self.request("status")

    def ready(self):
        st = wait_for(f"{self.name} to answer status", self.status)
        self.listen = st["listen"]
        self.short_id = st["short_id"]
        return self

    def cli_status(self):
        out = cli("status", "--json", "--data-dir", self.data_dir)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def log_text(self):
        return self.log_path.read_text()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture
def swarm_root():
    # Short paths: the control socket path must fit in 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="dtfm-mp-", dir="/tmp"))
    (root / "fast.toml").write_text(FAST)
    assert cli("swarm-key", "new", "--out", root / "swarm.key").returncode == 0
    peers: list[Peer] = []

    def start(name, bootstrap=(), key=None, extra=()):
        peer = Peer(root, name, key or root / "swarm.key", bootstrap, extra)
        peers.append(peer)
        return peer

    try:
        yield root, start
    finally:
        for peer in peers:
            peer.stop()
        shutil.rmtree(root, ignore_errors=True)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as answer:
        assert answer.status == 200
        return answer.read().decode()


def peer_ids(status):
    return sorted(p["short_id"] for p in status["peers"])


def test_two_daemons_find_each_other(swarm_root):
    root, start = swarm_root
    a = start("a", extra=["--metrics-listen", "127.0.0.1:0"]).ready()
    b = start("b", bootstrap=[a.listen]).ready()
    wait_for("a and b to connect", lambda: peer_ids(a.status()) == [b.short_id]
             and peer_ids(b.status()) == [a.short_id])
    # a's Prometheus endpoint, scraped and parsed: both members alive, one connected peer
    url = a.status()["metrics"]["url"]

    def connected_and_alive():
        text = scrape(url)
        samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name != "dtfm_members" or s.labels == {"state": "alive"}}
        if samples["dtfm_connected_peers"].value == 1 and samples["dtfm_members"].value == 2:
            return samples
        return None

    samples = wait_for("a's metrics to show b connected and both members alive", connected_and_alive)
    assert samples["dtfm_peer_info"].labels["region"] == "r-a"
    sa = a.cli_status()
    assert sa["region"] == "r-a"
    (entry,) = sa["peers"]
    assert entry["short_id"] == b.short_id and entry["region"] == "r-b"
    assert entry["address"] == b.listen
    text = cli("status", "--data-dir", b.data_dir)
    assert text.returncode == 0
    assert f"peer      {b.short_id}" in text.stdout
    assert f"{a.short_id}  {a.listen}  r-a" in text.stdout
    # gossip's part in words (members, this peer's links), not as a JSON line
    assert "\nmembers   " in text.stdout and "\nlinks     " in text.stdout and '"latency"' not in text.stdout


def test_three_daemons_one_bootstrap_then_leave_and_sigterm(swarm_root):
    root, start = swarm_root
    a = start("a").ready()
    b = start("b", bootstrap=[a.listen]).ready()
    c = start("c", bootstrap=[a.listen], extra=["--log-json"]).ready()
    everyone = {a.short_id, b.short_id, c.short_id}
    for p in (a, b, c):
        wait_for(f"{p.name} to see the other two",
                 lambda p=p: set(peer_ids(p.status())) == everyone - {p.short_id})
    for p in (a, b, c):
        assert set(peer_ids(p.cli_status())) == everyone - {p.short_id}

    out = cli("leave", "--data-dir", b.data_dir)
    assert out.returncode == 0, out.stderr
    assert "left" in out.stderr
    assert not DataDirLock(DataDir(Path(b.data_dir))).in_use()  # a daemon may start on it at once
    assert b.proc.wait(DEADLINE_S) == 0
    for p in (a, c):
        st = p.cli_status()
        assert b.short_id not in peer_ids(st)
        assert [d["short_id"] for d in st["departed"]] == [b.short_id]
        assert f"peer {b.short_id} left the swarm" in p.log_text()
        # gossip heard b's own LEFT claim before its connections closed: "left", never "dead"
        wait_for(f"{p.name}'s gossip to count {b.name} left", lambda p=p: {
            m["short_id"]: m["state"] for m in p.status()["gossip"]["members"]}.get(b.short_id) == "left")

    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(DEADLINE_S) == 0
    st = wait_for("a to see c leave",
                  lambda: (s := a.status()) and not s["peers"] and len(s["departed"]) == 2 and s)
    assert st["departed"][0]["reason"] == "received SIGTERM"
    assert "Traceback" not in b.log_text() + c.log_text()
    c_log = [json.loads(line) for line in c.log_text().splitlines()]
    assert {"ts", "level", "logger", "msg"} <= set(c_log[0])
    assert any(e["msg"] == "leaving the swarm: received SIGTERM" for e in c_log)


def test_wrong_swarm_key_is_refused_on_both_sides(swarm_root):
    root, start = swarm_root
    assert cli("swarm-key", "new", "--out", root / "other.key").returncode == 0
    a = start("a", extra=["--log-level", "debug"]).ready()  # a refusal's reason is logged at DEBUG
    x = start("x", bootstrap=[a.listen], key=root / "other.key").ready()
    wait_for("x to log the refusal", lambda: "refused the handshake" in x.log_text())
    wait_for("a to log the refusal", lambda: "refused handshake from" in a.log_text())
    assert "handshake refused" in x.log_text()  # all that x is told
    assert "swarm key mismatch" in a.log_text()  # a keeps the reason
    sa, sx = a.status(), x.status()
    assert sa["peers"] == [] and sx["peers"] == []
    assert sa["swarm_key_fingerprint"] != sx["swarm_key_fingerprint"]
    assert sa["swarm_key_fingerprint"] not in x.log_text()
    x.proc.send_signal(signal.SIGINT)
    assert x.proc.wait(DEADLINE_S) == 0


def test_status_and_leave_without_a_daemon(swarm_root):
    root, _ = swarm_root
    for command in ("status", "leave"):
        out = cli(command, "--data-dir", root / "nobody")
        assert out.returncode == 1
        assert out.stdout == ""
        assert out.stderr == (f"dtfm-peer: error: no daemon is running for data dir "
                              f"{root / 'nobody'}: start one with `dtfm-peer join`\n")


def test_second_daemon_on_one_data_dir_is_refused(swarm_root):
    root, start = swarm_root
    a = start("a").ready()
    out = cli("join", "--data-dir", a.data_dir, "--swarm-key", root / "swarm.key",
              "--listen", "127.0.0.1:0")
    assert out.returncode == 1
    assert "a daemon is already running for data dir" in out.stderr
    assert "Traceback" not in out.stderr
    port = a.listen.rsplit(":", 1)[1]
    busy = cli("join", "--data-dir", root / "other", "--swarm-key", root / "swarm.key",
               "--listen", a.listen)
    assert busy.returncode == 1
    assert f"dtfm-peer: error: cannot listen on 127.0.0.1:{port}: " in busy.stderr
    assert "Traceback" not in busy.stderr
    assert a.status() is not None   # the first one is undisturbed


def test_data_dir_from_environment(swarm_root):
    root, start = swarm_root
    env = dict(os.environ, XDG_DATA_HOME=str(root / "xdg"))
    out = cli("keygen", "--json", env=env)
    assert out.returncode == 0
    info = json.loads(out.stdout)
    assert info["data_dir"] == str(root / "xdg" / "dtfm")
    assert info["created"] is True
    key_file = root / "xdg" / "dtfm" / "identity.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    again = json.loads(cli("keygen", "--json", env=env).stdout)
    assert again["peer_id"] == info["peer_id"] and again["created"] is False
