"""The peer processes of a scripted swarm: starting, stopping, asking, waiting for convergence."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tomllib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from dtfm.files import atomic_write
from dtfm.peer import (SPEED_FILE, ControlClient, ControlClientError, DaemonNotRunning, DataDir, SelfSpeed,
                       SocketConfig, SpeedCache, speed_key)
from dtfm.scenarios import load_scenario

from .state import KEY_FILE, PeerEntry, SwarmError, SwarmState, pid_alive, send_signal

STOP_GRACE_S = 10.0
PROGRESS_EVERY_S = 10.0  # without a terminal, how often `up` logs the measurements' progress
NOMINAL_COMPUTE_MS = 30.0  # a figure for a swarm whose machine could not be measured (a 2020s CPU core's)
# Peers outlive the command that starts them; holding their Popen objects keeps Python from
# warning, when one is collected, that a child it started is still running.
_STARTED: dict[int, subprocess.Popen] = {}


# ---- talking to one peer --------------------------------------------------------------------

def _control_socket(peer: PeerEntry) -> Path:
    return DataDir(Path(peer.data_dir)).control_socket


def peer_request(peer: PeerEntry, op: str, args: dict | None = None, timeout_s: float = 5.0) -> Any:
    """One control request to a peer's daemon; raises SwarmError when it is not answering."""

    config = SocketConfig(request_timeout_s=timeout_s)
    try:
        with ControlClient(_control_socket(peer), config, data_dir=Path(peer.data_dir)) as c:
            return c.request(op, args or {})
    except (DaemonNotRunning, ControlClientError) as e:
        raise SwarmError(f"{peer.name}: {e}", code=getattr(e, "code", None)) from None


def peer_status(peer: PeerEntry) -> dict | None:
    if not peer.alive():
        return None
    try:
        return peer_request(peer, "status")
    except SwarmError:
        return None


# ---- processes ------------------------------------------------------------------------------

# Peers listen on ports below the kernel's ephemeral range: a port picked from that range and
# let go until the daemon binds it (seconds, while it imports torch) can meanwhile become the
# source port of any outgoing connection on the machine (another swarm's dials), and a peer
# restarted on its old port would race the same way.
LISTEN_PORTS_FLOOR = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low(default: int = 32768) -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free now, below the ephemeral range where the machine allows
    (else any the kernel hands out), held open together so none repeats."""
    low = _ephemeral_low()
    candidates = list(range(LISTEN_PORTS_FLOOR, low)) if low - LISTEN_PORTS_FLOOR >= 16 * n else []
    random.shuffle(candidates)
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# The coordinator steps down without acks from a quorum within its lease, each ack at least a
# round trip old: the lan election's 0.4 s lease holds while emulated round trips stay under a
# quarter of it (the rest is the heartbeat interval and a loaded machine's stalls).
LAN_ELECTION_MAX_RTT_MS = 100.0


def max_rtt_ms(state: SwarmState) -> float:
    """The longest emulated round trip between two of the scenario's regions; 0 on plain loopback."""

    if not state.emulated:
        return 0.0
    return 2 * float(load_scenario(state.scenario).delay_ms().max()) * state.time_scale


def gossip_profile(state: SwarmState) -> str:
    """lan timings while every emulated round trip fits well inside its 0.5 s probe timeout,
    wan timings (3 s timeout, more patience) beyond."""

    return "lan" if max_rtt_ms(state) < 200 else "wan"


def plane_flags(state: SwarmState) -> list[str]:
    """The control plane's profile (`up --plane-profile`, test by default: every daemon shares
    this machine, and the test profile's quick checks and short timeouts, which still let CPU
    stages build, make the swarm reconfigure in seconds), with the wan election where the
    emulated round trips outgrow the lan election's lease (the worldwide scenario's reach
    476 ms)."""

    flags = ["--plane-profile", state.plane_profile]
    if state.plane_profile != "wan" and max_rtt_ms(state) >= LAN_ELECTION_MAX_RTT_MS:
        flags += ["--election-profile", "wan"]
    return flags


def peer_compute_ms(state: SwarmState, region: str) -> float:
    """The compute figure a peer reports from its start: this machine's (every peer runs on
    it), over its region's compute_scale. Once a peer trains, it reports what its own steps
    measure instead (control/compute.py), which no compute_scale emulates."""

    return (state.compute_ms or NOMINAL_COMPUTE_MS) / load_scenario(state.scenario).region(region).compute_scale


def machine_compute_ms(run_dir: Path, device: str) -> float:
    """This machine's reference-block time (one torch thread, `dtfm.peer.speed`'s probe in a
    child process), kept in the run dir: measured once, not by each of the peers that share
    the machine. NOMINAL_COMPUTE_MS, with a warning, when the probe fails."""
    cache = SpeedCache(run_dir / SPEED_FILE, speed_key(device, 1))
    try:
        return SelfSpeed(cache, compute=True, codec=False).compute_ms()
    except RuntimeError as e:
        print(f"cannot measure this machine's compute speed ({e}): the peers report {NOMINAL_COMPUTE_MS:g} ms",
              file=sys.stderr)
        return NOMINAL_COMPUTE_MS


# Settings every peer of a scripted swarm reads (`join --config`): its links are emulated on
# this machine, so a bandwidth probe loads no real link and needs none of the profiles' spacing
# between two probes (2 s on the wan profile: 8 peers took about 30 s to measure their links).
# Every peer shares the loopback address, whose cap on members (gossip's
# max_members_per_loopback, 64 by default) must admit the whole swarm: the swarm's size plus
# room for the peers `dtfm-swarm join` adds, and no more (the cap is what bounds identities an
# intruder on this machine can add).
PEER_CONFIG = """\
# dtfm-swarm's settings for its peers (every link is emulated on this machine)
[gossip]
bandwidth_probe_interval_s = 0.25
bandwidth_probe_bytes = 262144
max_members_per_loopback = {loopback}
"""
PEER_CONFIG_FILE = "peers.toml"
KINDS_FILE = "kinds.json"  # the peers' shared layer-probe figures (`dtfm-peer join --kinds-file`)
LOOPBACK_MEMBERS = 64  # gossip's default cap, kept for swarms that fit in it


def loopback_cap(peers: int) -> int:
    """The loopback cap a scripted swarm of `peers` daemons runs with."""
    return max(LOOPBACK_MEMBERS, peers + 16)


def peer_config(run_dir: Path, peers: int) -> Path:
    """The run dir's settings file for its peers, written again when the swarm's size asks for
    another cap (peers already running keep theirs until restarted)."""
    path = run_dir / PEER_CONFIG_FILE
    text = PEER_CONFIG.format(loopback=loopback_cap(peers))
    try:
        current = path.read_text()
    except FileNotFoundError:
        current = None
    if current is None or (current != text and loopback_cap(peers) > _loopback_in(current)):
        atomic_write(path, text)
    return path


def _loopback_in(text: str) -> int:
    """The loopback cap a settings file holds (the default where it holds none or is damaged)."""
    try:
        cap = tomllib.loads(text).get("gossip", {}).get("max_members_per_loopback")
    except tomllib.TOMLDecodeError:
        return LOOPBACK_MEMBERS
    return cap if type(cap) is int else LOOPBACK_MEMBERS


def start_peer(run_dir: Path, state: SwarmState, peer: PeerEntry, extra: list[str], *,
               program: Sequence[str] = ("-m", "dtfm.peer")) -> None:
    """Start `peer`'s daemon (`program`: what the interpreter runs, given `join ...` after it;
    a test's own daemon may wrap the project's)."""
    others = [p for p in state.peers if p.name != peer.name]
    bootstrap = [a for p in others[:3] for a in ("--bootstrap", p.address)]
    emulate = (["--emulate", state.scenario, "--time-scale", repr(state.time_scale),
                "--bandwidth-scale", repr(state.bandwidth_scale)] if state.emulated else [])
    cmd = [sys.executable, *program, "join", "--config", str(peer_config(run_dir, len(state.peers))),
           "--listen", peer.address, "--data-dir", peer.data_dir,
           "--swarm-key", str(run_dir / KEY_FILE), "--region", peer.region, *emulate,
           "--gossip-profile", gossip_profile(state), *plane_flags(state),
           "--compute-ms", repr(peer_compute_ms(state, peer.region)),
           "--codec-speed", "reference",  # (the peers share one CPU: the same figure for each, no probe)
           "--layer-probe", state.layer_probe,
           *(("--pipeline-schedule", state.pipeline_schedule) if state.pipeline_schedule != "fitted" else ()),
           # (one machine: the coordinator's layer probe at a run's start serves every peer, so
           # no training peer probes beside its first steps on the cores they all share)
           *(("--kinds-file", str(run_dir / KINDS_FILE)) if state.layer_probe == "measure" else ()),
           *(a for d in state.model_dirs for a in ("--model-dir", d)),
           *(("--device", state.device) if state.device != "cpu" else ()),
           "--log-file", str(peer.log_file),  # (rotated by the daemon; what else it prints: daemon.out)
           *bootstrap, *extra]
    Path(peer.data_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(peer.out_file, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, close_fds=True)
    _STARTED[proc.pid] = proc
    peer.pid = proc.pid


def stop_peer(peer: PeerEntry, *, graceful: bool = True) -> None:
    if not peer.alive():
        if peer.pid is not None:
            _reap(peer.pid)
        return
    assert peer.pid is not None
    if graceful:
        try:
            peer_request(peer, "leave", timeout_s=2.0)
        except SwarmError:
            send_signal(peer.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and pid_alive(peer.pid):
            _reap(peer.pid)
            time.sleep(0.05)
    if pid_alive(peer.pid):
        send_signal(peer.pid, signal.SIGKILL)
    _reap(peer.pid, wait_s=5.0)


def stop_peers(peers: list[PeerEntry], *, graceful: bool = True) -> None:
    """Stop every peer (all asked to leave at once, then waited for; SIGKILL for those still
    running after STOP_GRACE_S) and reap those that had died; each one's pid is cleared."""
    live = [p for p in peers if p.alive()]
    if graceful:
        for peer in live:
            assert peer.pid is not None
            try:
                peer_request(peer, "leave", timeout_s=2.0)
            except SwarmError:
                send_signal(peer.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(p.pid is not None and pid_alive(p.pid) for p in live):
            for peer in live:
                if peer.pid is not None:
                    _reap(peer.pid)
            time.sleep(0.05)
    for peer in peers:
        stop_peer(peer, graceful=False)
        peer.pid = None


def _reap(pid: int, wait_s: float = 0.0) -> None:
    """Collect the exit status of a peer this process started, so it leaves no zombie."""
    proc = _STARTED.get(pid)
    if proc is not None:
        try:
            proc.wait(timeout=wait_s) if wait_s else proc.poll()
        except subprocess.TimeoutExpired:
            return
        if proc.returncode is not None:
            del _STARTED[pid]
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# ---- convergence ----------------------------------------------------------------------------

def swarm_view(report: dict) -> tuple[int, int, int, bool]:
    """(alive members, measured links, expected links, ready) as one peer's status reports
    them; ready: its view is good to schedule with: every link measured where the peer
    measures every link (`full_mesh`), else a figure, measured or estimated, for every pair."""
    gossip = report.get("gossip") or {}
    members = gossip.get("members") or []
    alive = sum(1 for m in members if m.get("state") == "alive")
    view = gossip.get("view") or {}
    measured, expected = int(view.get("measured_links", 0)), int(view.get("expected_links", 0))
    full = view.get("full_mesh", True)
    ready = expected > 0 and (measured >= expected if full else bool(view.get("complete", False)))
    return alive, measured, expected, ready


def wait_converged(state: SwarmState, timeout_s: float, *, need_measurements: bool,
                   out: TextIO = sys.stderr) -> None:
    """Block until every live peer sees every live peer alive (and, if asked, a complete view)."""
    deadline = time.monotonic() + timeout_s
    live = [p for p in state.peers if p.alive()]
    n = len(live)
    tty = out.isatty()
    last = ""
    last_printed_at = -float("inf")
    last_phase: tuple[int, int] | None = None
    while True:
        joined = measured = expected = ready = 0
        reports = {}
        for p in live:
            rep = peer_status(p)
            if rep is None:
                continue
            reports[p.name] = rep
            p.peer_id = str(rep.get("peer_id", p.peer_id))
            alive, m, e, r = swarm_view(rep)
            joined += alive == n
            measured += m
            expected += e
            ready += r
        complete = ready == n
        # measured/expected: directed links each peer's own view has measurements for, summed
        # over the peers (n peers x n - 1 links each when complete); past gossip's full-mesh
        # size the rest are estimated, and a peer is ready once its view is complete
        line = (f"peers answering {len(reports)}/{n}, seeing all {joined}/{n}"
                + (f", views ready {ready}/{n}, links measured {measured}/{expected} (each peer's view of the "
                   f"{max(n - 1, 0) * n} directed links)" if need_measurements else ""))
        now = time.monotonic()
        phase = (len(reports), joined)
        done = joined == n and (complete or not need_measurements)
        # a terminal rewrites one line; a log gets a line when the peers' count changes, at most
        # one every PROGRESS_EVERY_S while only the measurements move, and the last one
        if line != last and (tty or phase != last_phase or done or now - last_printed_at >= PROGRESS_EVERY_S):
            print(("\r" if tty else "") + line, end="" if tty else "\n", file=out, flush=True)
            last, last_phase, last_printed_at = line, phase, now
        if done:
            if tty:
                print(file=out)
            return
        dead = [p.name for p in live if not p.alive()]
        if dead:
            raise SwarmError(f"peer(s) {', '.join(dead)} exited while starting: see their "
                             f"daemon.log and daemon.out (what a crash printed) in the run directory")
        if time.monotonic() > deadline:
            if tty:
                print(file=out)
            raise SwarmError(f"the swarm did not converge within {timeout_s:g} s ({line}): see "
                             f"the peers' daemon.log files, or raise --timeout")
        time.sleep(0.25)
