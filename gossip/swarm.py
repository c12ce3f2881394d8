"""`dtfm-swarm`: scripted multi-region test swarms on one machine.

Starts one `dtfm-peer join` process per peer on loopback, with regions assigned as a scenario
file says (scaled down to the requested count, keeping proportions) and every link emulated
inside the peers' transports (delay line + rate limiter per destination region). State lives in
a run directory so every subcommand works from any shell.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .swarmstate import (KEY_FILE, PeerEntry, SwarmError, SwarmState, default_run_dir,
                         load_state, pid_alive, save_state, send_signal)

STOP_GRACE_S = 10.0
NOMINAL_COMPUTE_MS = 10.0
# Peers outlive the command that starts them; holding their Popen objects keeps Python from
# warning, when one is collected, that a child it started is still running.
_STARTED: dict[int, subprocess.Popen] = {}


# ---- talking to one peer --------------------------------------------------------------------

def _control_socket(peer: PeerEntry) -> Path:
    from dtfm.peer.paths import DataDir

    return DataDir(Path(peer.data_dir)).control_socket


def peer_request(peer: PeerEntry, op: str, args: dict | None = None, timeout_s: float = 5.0) -> Any:
    """One control request to a peer's daemon; raises SwarmError when it is not answering."""
    from dtfm.peer.config import ControlConfig
    from dtfm.peer.control import ControlClient, ControlClientError, DaemonNotRunning

    config = ControlConfig(request_timeout_s=timeout_s)
    try:
        with ControlClient(_control_socket(peer), config, data_dir=Path(peer.data_dir)) as c:
            return c.request(op, args or {})
    except (DaemonNotRunning, ControlClientError) as e:
        raise SwarmError(f"{peer.name}: {e}") from None


def peer_status(peer: PeerEntry) -> dict | None:
    if not peer.alive():
        return None
    try:
        return peer_request(peer, "status")
    except SwarmError:
        return None


# ---- processes ------------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def gossip_profile(state: SwarmState) -> str:
    """lan timings while every emulated round trip fits well inside its 0.5 s probe timeout,
    wan timings (3 s timeout, more patience) beyond."""
    from dtfm.sched.scenario import load_scenario

    max_rtt_ms = 2 * float(load_scenario(state.scenario).delay_ms().max()) * state.time_scale
    return "lan" if max_rtt_ms < 200 else "wan"


def nominal_compute_ms(state: SwarmState, region: str) -> float:
    """Every peer shares this machine's CPU, so a measured speed would say nothing about the
    scenario: peers report a nominal speed, scaled by their region's compute_scale."""
    from dtfm.sched.scenario import load_scenario

    return NOMINAL_COMPUTE_MS / load_scenario(state.scenario).region(region).compute_scale


def start_peer(run_dir: Path, state: SwarmState, peer: PeerEntry, extra: list[str]) -> None:
    others = [p for p in state.peers if p.name != peer.name]
    bootstrap = [a for p in others[:3] for a in ("--bootstrap", p.address)]
    cmd = [sys.executable, "-m", "dtfm.peer", "join",
           "--listen", peer.address, "--data-dir", peer.data_dir,
           "--swarm-key", str(run_dir / KEY_FILE), "--region", peer.region,
           "--emulate", state.scenario,
           "--time-scale", repr(state.time_scale), "--bandwidth-scale", repr(state.bandwidth_scale),
           "--gossip-profile", gossip_profile(state),
           "--compute-ms", repr(nominal_compute_ms(state, peer.region)),
           *bootstrap, *extra]
    Path(peer.data_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(peer.log_file, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
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

def swarm_view(report: dict) -> tuple[int, int, int]:
    """(alive members, measured links, expected links) as one peer's status reports them."""
    gossip = report.get("gossip") or {}
    members = gossip.get("members") or []
    alive = sum(1 for m in members if m.get("state") == "alive")
    view = gossip.get("view") or {}
    return alive, int(view.get("measured_links", 0)), int(view.get("expected_links", 0))


def wait_converged(state: SwarmState, timeout_s: float, *, need_measurements: bool,
                   out=sys.stderr) -> None:
    """Block until every live peer sees every live peer alive (and, if asked, a complete view)."""
    deadline = time.monotonic() + timeout_s
    live = [p for p in state.peers if p.alive()]
    n = len(live)
    tty = out.isatty()
    last = ""
    while True:
        joined = measured = expected = 0
        reports = {}
        for p in live:
            rep = peer_status(p)
            if rep is None:
                continue
            reports[p.name] = rep
            p.peer_id = str(rep.get("peer_id", p.peer_id))
            alive, m, e = swarm_view(rep)
            joined += alive == n
            measured += m
            expected += e
        complete = expected > 0 and measured >= expected
        line = (f"peers answering {len(reports)}/{n}, seeing all {joined}/{n}"
                + (f", measurements {measured}/{expected}" if need_measurements else ""))
        if line != last:
            print(("\r" if tty else "") + line, end="" if tty else "\n", file=out, flush=True)
            last = line
        if joined == n and (complete or not need_measurements):
            if tty:
                print(file=out)
            return
        dead = [p.name for p in live if not p.alive()]
        if dead:
            raise SwarmError(f"peer(s) {', '.join(dead)} exited while starting: see their "
                             f"daemon.log in the run directory")
        if time.monotonic() > deadline:
            if tty:
                print(file=out)
            raise SwarmError(f"the swarm did not converge within {timeout_s:g} s ({line}): see "
                             f"the peers' daemon.log files, or raise --timeout")
        time.sleep(0.25)


# ---- status ---------------------------------------------------------------------------------

def status_report(state: SwarmState) -> dict:
    """The whole swarm as one JSON-able dict, the measured matrix as seen by one live peer."""
    peers_out = []
    observer = None
    for p in state.peers:
        rep = peer_status(p)
        if rep is not None:
            p.peer_id = str(rep.get("peer_id", p.peer_id))
            observer = observer or rep
        peers_out.append({"name": p.name, "index": p.index, "id": p.peer_id, "region": p.region,
                          "address": p.address, "pid": p.pid,
                          "state": "running" if rep is not None else
                          ("unresponsive" if p.alive() else "stopped")})
    report: dict[str, Any] = {"scenario": state.scenario_name, "run_dir": None,
                              "time_scale": state.time_scale,
                              "bandwidth_scale": state.bandwidth_scale, "peers": peers_out}
    if observer is not None:
        gossip_members = {m.get("id"): m for m in (observer.get("gossip") or {}).get("members", [])}
        for entry in peers_out:
            m = gossip_members.get(entry["id"])
            if m is not None:
                entry["member_state"] = m.get("state")
        report["observer"] = observer.get("peer_id")
        report["measured"] = measured_matrices(observer, [p["id"] for p in peers_out],
                                               state.time_scale, state.bandwidth_scale)
    return report


def measured_matrices(report: dict, ids: list[str], time_scale: float,
                      bandwidth_scale: float) -> dict:
    """The observer's view reordered to `ids`, in scenario units (scales divided out)."""
    view = (report.get("gossip") or {}).get("view") or {}
    order = {pid: k for k, pid in enumerate(view.get("peers", []))}
    raw_delay = view.get("delay_ms") or []
    raw_bw = view.get("bandwidth_gbps") or []
    n = len(ids)

    def pick(matrix: list, i: int, j: int) -> float | None:
        a, b = order.get(ids[i]), order.get(ids[j])
        if a is None or b is None or a >= len(matrix) or b >= len(matrix[a]):
            return None
        return matrix[a][b]

    raw_d = [[pick(raw_delay, i, j) for j in range(n)] for i in range(n)]
    raw_b = [[pick(raw_bw, i, j) for j in range(n)] for i in range(n)]
    # The emulator stretches delays by time_scale and carries bandwidth x bandwidth_scale /
    # time_scale: divide both back out.
    bw_factor = time_scale / bandwidth_scale
    return {
        "delay_ms": [[None if v is None else v / time_scale for v in row] for row in raw_d],
        "bandwidth_gbps": [[None if v is None else v * bw_factor for v in row] for row in raw_b],
        "raw_delay_ms": raw_d,
        "raw_bandwidth_gbps": raw_b,
        "complete": bool(view.get("complete", False)),
    }


def format_status(report: dict) -> str:
    rows = [["NAME", "ID", "REGION", "ADDRESS", "PID", "PROCESS", "MEMBER"]]
    for p in report["peers"]:
        rows.append([p["name"], (p["id"] or "-")[:8], p["region"], p["address"],
                     str(p["pid"] or "-"), p["state"], p.get("member_state", "-")])
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = [f"swarm: scenario {report['scenario']}, {len(report['peers'])} peers, "
             f"time scale {report['time_scale']:g}, bandwidth scale {report['bandwidth_scale']:g}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    measured = report.get("measured")
    if measured:
        names = [p["name"] for p in report["peers"]]
        lines.append("")
        lines.append("measured one-way delay (ms) / bandwidth (Gbps), scenario units"
                     + ("" if measured["complete"] else " -- incomplete"))
        width = 11
        lines.append(" " * 5 + "".join(n.rjust(width) for n in names))
        for i, name in enumerate(names):
            cells = []
            for j in range(len(names)):
                d, b = measured["delay_ms"][i][j], measured["bandwidth_gbps"][i][j]
                cells.append(("-" if i == j or d is None or b is None
                              else f"{d:.0f}/{b:.2f}").rjust(width))
            lines.append(name.ljust(5) + "".join(cells))
    return "\n".join(lines)


# ---- subcommands ----------------------------------------------------------------------------

def cmd_up(args: argparse.Namespace) -> int:
    from dtfm.peer.identity import new_swarm_key
    from dtfm.sched.scenario import ScenarioError, load_scenario

    run_dir: Path = args.run_dir
    try:
        existing = load_state(run_dir)
    except SwarmError:
        existing = None
    if existing is not None and any(p.alive() for p in existing.peers):
        raise SwarmError(f"a swarm is already running in {run_dir}: stop it with "
                         f"`dtfm-swarm down --run-dir {run_dir}` first")
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as e:
        raise SwarmError(str(e)) from None
    n = args.peers or scenario.n_peers
    if not 2 <= n <= 256:
        raise SwarmError(f"--peers must be between 2 and 256, got {n}")
    if args.time_scale <= 0 or args.bandwidth_scale <= 0:
        raise SwarmError("--time-scale and --bandwidth-scale must be positive")
    small = scenario.scaled(n)
    scenario_ref = str(Path(args.scenario).resolve()) if Path(args.scenario).exists() else args.scenario
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_file = run_dir / KEY_FILE
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_swarm_key() + "\n")
    ports = free_ports(n)
    state = SwarmState(scenario=scenario_ref, scenario_name=scenario.name,
                       time_scale=args.time_scale, bandwidth_scale=args.bandwidth_scale)
    for k, region in enumerate(small.peer_regions()):
        name = f"p{k:02d}"
        state.peers.append(PeerEntry(name=name, index=k, region=region, port=ports[k],
                                     data_dir=str(run_dir / name)))
    extra = ["--log-json"] if args.log_json else []
    print(f"starting {n} peers of scenario {scenario.name} in {run_dir}", file=sys.stderr)
    try:
        for peer in state.peers:
            start_peer(run_dir, state, peer, extra)
        save_state(run_dir, state)
        wait_converged(state, args.timeout, need_measurements=not args.no_wait_measurements)
    except BaseException:
        if not args.keep_on_failure:
            for peer in state.peers:
                stop_peer(peer, graceful=False)
        save_state(run_dir, state)
        raise
    save_state(run_dir, state)
    print(f"swarm up: {n} peers; `dtfm-swarm status --run-dir {run_dir}` shows it", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    report = status_report(state)
    report["run_dir"] = str(args.run_dir)
    save_state(args.run_dir, state)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_status(report))
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    peer = state.find(args.peer)
    if not peer.alive():
        raise SwarmError(f"{peer.name} is not running")
    try:
        sig = signal.Signals[f"SIG{args.signal.upper().removeprefix('SIG')}"]
    except KeyError:
        raise SwarmError(f"no signal {args.signal!r}: use a name such as KILL, TERM or STOP") from None
    assert peer.pid is not None
    send_signal(peer.pid, sig)
    print(f"sent {sig.name} to {peer.name} (pid {peer.pid})", file=sys.stderr)
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    peer = state.find(args.peer)
    stop_peer(peer, graceful=True)
    start_peer(args.run_dir, state, peer, ["--log-json"] if args.log_json else [])
    save_state(args.run_dir, state)
    print(f"restarted {peer.name} (pid {peer.pid}) with data dir {peer.data_dir}", file=sys.stderr)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    running = [p for p in state.peers if p.alive()]
    for peer in running:
        stop_peer(peer, graceful=not args.kill)
    for peer in state.peers:
        peer.pid = None
    save_state(args.run_dir, state)
    print(f"stopped {len(running)} peers; logs stay in {args.run_dir}", file=sys.stderr)
    return 0


def _select(state: SwarmState, ref: str) -> list[PeerEntry]:
    """Peers by region name, or one peer by name/index/id prefix."""
    in_region = [p for p in state.peers if p.region == ref]
    return in_region or [state.find(ref)]


def cmd_partition(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    side_a, side_b = _select(state, args.a), _select(state, args.b)
    ids_b = [p.peer_id for p in side_b]
    ids_a = [p.peer_id for p in side_a]
    if not all(ids_a + ids_b):
        raise SwarmError("some peer ids are unknown yet: run `dtfm-swarm status` once the swarm is up")
    for p in side_a:
        peer_request(p, "emulate", {"cut": ids_b})
    if not args.one_way:
        for p in side_b:
            peer_request(p, "emulate", {"cut": ids_a})
    print(f"cut {'one-way ' if args.one_way else ''}links {args.a} -> {args.b}", file=sys.stderr)
    return 0


def cmd_heal(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    for p in state.peers:
        if p.alive():
            peer_request(p, "emulate", {"heal": True})
    print("all emulated links restored", file=sys.stderr)
    return 0


def schedule_measured(report: dict, *, time_budget_s: float = 5.0):
    """Run the scheduler on the swarm's measured view for the demo model (train's `tiny`)."""
    import numpy as np

    from dtfm.sched import ModelSpec, solve

    measured = report["measured"]
    delay = np.array([[0.0 if v is None else v for v in row] for row in measured["delay_ms"]])
    bw = np.array([[np.inf if v is None else v for v in row] for row in measured["bandwidth_gbps"]])
    np.fill_diagonal(bw, np.inf)
    spec = ModelSpec("tiny", layers=4, hidden=128, heads=4, seq_len=128, vocab=256,
                     micro_batch_size=2, global_batch_seqs=8 * len(delay))
    regions = [p["region"] for p in report["peers"]]
    # Every peer takes part: with communication alone in the objective, leaving peers out as
    # spares would always look cheaper.
    return solve(delay, bw, spec, stages="auto", regions=regions, time_budget_s=time_budget_s,
                 allow_spares=False)


def format_allocation(report: dict, alloc) -> str:
    names = [f"{p['name']}({p['region']})" for p in report["peers"]]
    lines = [f"allocation on the measured view: {alloc.stages} stages x {alloc.dp} pipelines, "
             f"predicted cost {alloc.cost.paper_s:.3f} s (DP {alloc.cost.dp_s:.3f} + "
             f"2 x PP {alloc.cost.pp_s:.3f})"]
    for k, pipe in enumerate(alloc.pipelines):
        lines.append(f"  pipeline {k}: " + " -> ".join(names[i] for i in pipe))
    if alloc.spares:
        lines.append("  spares: " + ", ".join(names[i] for i in alloc.spares))
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    """Start a swarm, measure it, schedule on the measurements, train in that shape, stop."""
    args.no_wait_measurements = False
    args.keep_on_failure = False
    args.log_json = False
    cmd_up(args)
    try:
        state = load_state(args.run_dir)
        report = status_report(state)
        print(format_status(report), flush=True)
        alloc = schedule_measured(report)
        print("\n" + format_allocation(report, alloc), flush=True)
        cmd = [sys.executable, "-m", "dtfm.train", "--preset", "tiny", "--steps", str(args.steps),
               "--stages", str(alloc.stages), "--dp", str(alloc.dp), "--micro-batches", "4",
               "--batch", str(8 * alloc.dp)]
        print(f"\ntraining the tiny model as {alloc.stages} x {alloc.dp} on this machine "
              f"(stage replicas in threads over the in-memory Comm): {' '.join(cmd[1:])}",
              flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            raise SwarmError(f"training exited with status {rc}")
    finally:
        cmd_down(argparse.Namespace(run_dir=args.run_dir, kill=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtfm-swarm",
        description="Run a scripted multi-region test swarm of dtfm peers on this machine, "
                    "with inter-region links emulated from a scenario file.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", type=Path, default=default_run_dir(),
                        help="where the swarm keeps its state, keys and peer data dirs "
                             "(default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_up_args(p: argparse.ArgumentParser, peers_default: int | None) -> None:
        p.add_argument("--scenario", default="worldwide",
                       help="built-in scenario name (datacenter, spot, universities, regional, "
                            "worldwide) or a scenario TOML file (default: %(default)s)")
        p.add_argument("--peers", type=int, default=peers_default,
                       help="number of peers; regions keep the scenario's proportions "
                            "(default: %(default)s)")
        p.add_argument("--time-scale", type=float, default=1.0,
                       help="multiply every emulated delay by this (default: %(default)s)")
        p.add_argument("--bandwidth-scale", type=float, default=0.05,
                       help="multiply every emulated bandwidth by this, so loopback can carry "
                            "the scenario's links (default: %(default)s)")
        p.add_argument("--timeout", type=float, default=180.0,
                       help="seconds to wait for the swarm to converge (default: %(default)s)")

    p = sub.add_parser("up", parents=[common], help="start a swarm and wait until it converges")
    add_up_args(p, 8)
    p.add_argument("--no-wait-measurements", action="store_true",
                   help="return once membership converged, before every link is measured")
    p.add_argument("--keep-on-failure", action="store_true",
                   help="leave the peers running when the swarm does not converge, to debug")
    p.add_argument("--log-json", action="store_true", help="peers log JSON lines")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("status", parents=[common], help="one table of the whole swarm")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("kill", parents=[common], help="signal one peer (SIGKILL by default)")
    p.add_argument("peer", help="peer name (p03), index, or peer-id prefix")
    p.add_argument("--signal", default="KILL", help="signal name (default: %(default)s)")
    p.set_defaults(func=cmd_kill)

    p = sub.add_parser("restart", parents=[common],
                       help="stop one peer if running and start it again with its data dir")
    p.add_argument("peer", help="peer name (p03), index, or peer-id prefix")
    p.add_argument("--log-json", action="store_true", help="the peer logs JSON lines")
    p.set_defaults(func=cmd_restart)

    p = sub.add_parser("down", parents=[common], help="stop every peer (gracefully by default)")
    p.add_argument("--kill", action="store_true", help="SIGKILL instead of a graceful leave")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("partition", parents=[common],
                       help="cut the emulated links between two regions or peers")
    p.add_argument("a", help="region name, or one peer")
    p.add_argument("b", help="region name, or one peer")
    p.add_argument("--one-way", action="store_true", help="cut only the direction a -> b")
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser("heal", parents=[common], help="restore every cut link")
    p.set_defaults(func=cmd_heal)

    p = sub.add_parser("demo", parents=[common],
                       help="start a small multi-region swarm, measure its links, schedule the "
                            "tiny model on the measurements, train it in that shape, stop")
    add_up_args(p, 6)
    p.add_argument("--steps", type=int, default=60, help="training steps (default: %(default)s)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SwarmError as e:
        print(f"dtfm-swarm: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dtfm-swarm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
