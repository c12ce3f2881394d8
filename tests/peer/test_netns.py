"""Three daemons on three "hosts": network namespaces with their own addresses (10.77.0.1-3/24)
joined by a bridge, each daemon listening on 0.0.0.0:7450 as on real machines.

Checks that every member is listed at its real address (not 127.0.0.1 or a wildcard), both in
each daemon's peers and in every gossip member table, and that after one host's link is cut
and restored the swarm heals: that host is alive again in every member's table.

Needs root and iproute2 (`ip netns`); skipped with the reason otherwise. Namespaces, the
bridge, processes and directories are removed in a finally, also when the test fails.
"""

import json
import os
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(110)]

DEADLINE_S = 30.0
PORT = 7450
TAG = f"d{os.getpid() % 100000}"          # interface names hold at most 15 characters
HOSTS = [f"10.77.0.{i}" for i in (1, 2, 3)]
CONFIG = """
[discovery]
retry_initial_s = 0.1
retry_max_s = 1.0
exchange_interval_s = 0.5

[transport]
keepalive_interval_s = 0.5
idle_timeout_s = 2.0
"""


def _run(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=20, check=check)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    probe = f"dtfmprobe{TAG}"
    out = _run("ip", "netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"`ip netns add` does not work here: {out.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


class Hosts:
    """A bridge and one namespace per host, with a veth pair each."""

    def __init__(self):
        self.bridge = f"br{TAG}"
        self.names = [f"ns{TAG}{i}" for i in range(len(HOSTS))]
        self.outer = [f"vh{TAG}{i}" for i in range(len(HOSTS))]     # bridge side
        self.made: list[tuple[str, ...]] = []

    def up(self):
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self.made.append(("ip", "link", "del", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        for ns, outer, host in zip(self.names, self.outer, HOSTS):
            _run("ip", "netns", "add", ns)
            self.made.append(("ip", "netns", "del", ns))
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.made.append(("ip", "link", "del", outer))
            _run("ip", "link", "set", outer, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{host}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def down(self):
        for cmd in reversed(self.made):
            _run(*cmd, check=False)


class Daemon:
    def __init__(self, root: Path, ns: str, name: str, bootstrap: str | None):
        self.name = name
        self.data_dir = root / name
        self.log_path = root / f"{name}.log"
        args = ["ip", "netns", "exec", ns, sys.executable, "-m", "dtfm.peer", "join",
                "--config", root / "fast.toml", "--data-dir", self.data_dir,
                "--swarm-key", root / "swarm.key", "--listen", f"0.0.0.0:{PORT}",
                "--gossip-profile", "local", "--compute-ms", "5", "--codec-speed", "reference",
                "--layer-probe", "off", "--region", name]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(a) for a in args], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def status(self):
        try:
            with ControlClient(self.data_dir / "control" / "peer.sock",
                               SocketConfig(request_timeout_s=5.0)) as c:
                return c.request("status")
        except (DaemonNotRunning, ControlClientError):
            return None

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def wait_for(what, condition, daemons, deadline_s=DEADLINE_S):
    """`polling.wait_for`, with the daemons' logs when it gives up."""
    return polling.wait_for(what, condition, deadline_s, detail=lambda: "\n".join(
        f"--- {d.name}\n{d.log_path.read_text()[-3000:]}" for d in daemons))


def members(status) -> dict[str, tuple[str, str]]:
    """region -> (address, state) from a status report's gossip members table."""
    gossip = (status or {}).get("gossip") or {}
    return {m["region"]: (m["address"], m["state"]) for m in gossip.get("members", [])}


def test_daemons_on_separate_hosts_advertise_real_addresses_and_heal_after_a_cut():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="dtfm-ns-", dir="/tmp"))
    hosts = Hosts()
    daemons: list[Daemon] = []
    try:
        hosts.up()
        (root / "fast.toml").write_text(CONFIG)
        made = subprocess.run([sys.executable, "-m", "dtfm.peer", "swarm-key", "new", "--out",
                               str(root / "swarm.key")], capture_output=True, timeout=30, check=False)
        assert made.returncode == 0, made.stderr
        names = ["h1", "h2", "h3"]
        for i, (ns, name) in enumerate(zip(hosts.names, names)):
            daemons.append(Daemon(root, ns, name, None if i == 0 else f"{HOSTS[0]}:{PORT}"))
        want = {name: (f"{host}:{PORT}", "alive") for name, host in zip(names, HOSTS)}

        def converged():
            reports = [d.status() for d in daemons]
            return all(r is not None and members(r) == want for r in reports) and reports

        reports = wait_for("every member listed alive at its real address", converged, daemons)
        for report, host in zip(reports, HOSTS):
            assert report["advertise"] == f"{host}:{PORT}"
            assert sorted(p["address"] for p in report["peers"]) == sorted(
                f"{h}:{PORT}" for h in HOSTS if h != host)

        # `dtfm-peer status --json` inside a namespace says the same.
        out = subprocess.run(["ip", "netns", "exec", hosts.names[1], sys.executable, "-m",
                              "dtfm.peer", "status", "--json", "--data-dir",
                              str(daemons[1].data_dir)], capture_output=True, text=True,
                             timeout=30, check=False)
        assert out.returncode == 0, out.stderr
        assert members(json.loads(out.stdout)) == want

        # Cut h3 off the bridge: the others stop seeing it alive.
        _run("ip", "link", "set", hosts.outer[2], "down")
        wait_for("h3 to be suspected or dead on h1 and h2",
                 lambda: all(members(d.status()).get("h3", ("", "alive"))[1] != "alive"
                             for d in daemons[:2]), daemons)
        # Restore it: every member lists h3 alive at its address again.
        _run("ip", "link", "set", hosts.outer[2], "up")
        wait_for("the swarm to heal", converged, daemons, deadline_s=40.0)
    finally:
        for d in daemons:
            d.stop()
        hosts.down()
        shutil.rmtree(root, ignore_errors=True)
