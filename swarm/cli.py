"""`dtfm-swarm`: scripted multi-region test swarms on one machine.

Starts one `dtfm-peer join` process per peer on loopback, with regions assigned as a scenario
file says (scaled down to the requested count, keeping proportions) and every link emulated
inside the peers' transports (delay line + rate limiter per destination region). State lives in
a run directory so every subcommand works from any shell.

Exit status: 0 success, 1 an error explained on stderr (`dtfm-swarm: error: ...`), 2 bad
command line, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import sys
from pathlib import Path

from dtfm.control import PLACEMENTS
from dtfm.net import EmulationConfig, new_swarm_key
from dtfm.peer import PLANE_PROFILES
from dtfm.scenarios import ScenarioError, load_scenario

from .proc import LAN_ELECTION_MAX_RTT_MS, free_ports, peer_request, start_peer, stop_peer, wait_converged
from .report import DEMO_PRESET, format_event, format_reconfigurations, format_status, status_report
from .state import (
    KEY_FILE,
    STATE_FILE,
    PeerEntry,
    SwarmError,
    SwarmState,
    check_run_dir,
    default_run_dir,
    ensure_run_dir,
    load_state,
    save_state,
    send_signal,
    write_secret_file,
)
from .train import EVENTS_NAME, LOG_NAME, current_run, plot_loss, read_log, start_training, sync_logs, wait_step

PROG = "dtfm-swarm"

def version_text() -> str:
    """What `--version` prints: the installed distribution's version."""
    try:
        return f"%(prog)s {importlib.metadata.version('dtfm')}"
    except importlib.metadata.PackageNotFoundError:
        return "%(prog)s (version unknown: dtfm is not installed)"


# ---- subcommands ----------------------------------------------------------------------------

def cmd_up(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    existing = None
    if os.path.lexists(run_dir):
        check_run_dir(run_dir)  # another user's or an open dir is refused, not reused
        if (run_dir / STATE_FILE).exists():
            try:
                existing = load_state(run_dir)
            except SwarmError:
                existing = None  # another version's state: replaced below
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
    try:  # the peers' link emulator checks the scales; refuse them before starting any
        EmulationConfig(time_scale=args.time_scale, bandwidth_scale=args.bandwidth_scale)
    except ValueError as e:
        raise SwarmError(f"--time-scale / --bandwidth-scale: {e}") from None
    small = scenario.scaled(n)
    scenario_ref = str(Path(args.scenario).resolve()) if Path(args.scenario).exists() else args.scenario
    ensure_run_dir(run_dir)
    write_secret_file(run_dir / KEY_FILE, (new_swarm_key() + "\n").encode("ascii"))
    ports = free_ports(n)
    state = SwarmState(scenario=scenario_ref, scenario_name=scenario.name,
                       time_scale=args.time_scale, bandwidth_scale=args.bandwidth_scale,
                       emulated=not getattr(args, "no_emulation", False), plane_profile=args.plane_profile)
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
    if getattr(args, "train", False):
        _train(state, args)
    return 0


def _train_request(args: argparse.Namespace) -> dict:
    if args.dp is not None and args.stages is None:
        raise SwarmError("--dp needs --stages S")
    return {"preset": args.preset, "steps": args.steps, "seed": args.seed,
            "stages": args.stages if args.stages is not None else "auto", "dp": args.dp,
            "checkpoint_every": args.checkpoint_every, "placement": args.placement}


def _train(state: SwarmState, args: argparse.Namespace) -> dict:
    """`train start` on the first live peer: it schedules, hands out and starts the run."""
    peer = next((p for p in state.peers if p.alive()), None)
    if peer is None:
        raise SwarmError("no peer is running")
    reply = start_training(state, peer, _train_request(args), run_dir=args.run_dir)
    print(f"training {args.preset} for {reply['steps']} steps as {reply['stages']} stages x "
          f"{reply['dp']} pipelines, issued by {peer.name}; predicted {reply['predicted_iteration_s']:.3f} s "
          f"per step", file=sys.stderr)
    return reply


def cmd_train(args: argparse.Namespace) -> int:
    reply = _train(load_state(args.run_dir), args)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    last = wait_step(state, args.run_dir, args.step, args.timeout)
    print(f"step {last['step']} completed; log in {args.run_dir / LOG_NAME}", file=sys.stderr)
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    """The run's events, merged from every peer's data dir (the run dir's copy is refreshed)."""
    state = load_state(args.run_dir)
    _, events = sync_logs(args.run_dir, state)
    if args.json:
        print(json.dumps(events, indent=2, sort_keys=True))
    elif not events:
        print(f"no events yet: no coordinator has written {EVENTS_NAME} in a peer's data dir", file=sys.stderr)
    else:
        for e in events:
            print(format_event(e))
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
    sync_logs(args.run_dir, state)
    running = [p for p in state.peers if p.alive()]
    for peer in state.peers:  # a peer killed earlier is only reaped: it leaves no zombie behind
        stop_peer(peer, graceful=not args.kill)
        peer.pid = None
    save_state(args.run_dir, state)
    print(f"stopped {len(running)} peers; logs stay in {args.run_dir}", file=sys.stderr)
    return 0


def _select(state: SwarmState, ref: str) -> list[PeerEntry]:
    """Peers by region name, or one peer by name/index/id prefix."""
    in_region = [p for p in state.peers if p.region == ref]
    return in_region or [state.find(ref)]


def _need_emulation(state: SwarmState, what: str) -> None:
    if not state.emulated:
        raise SwarmError(f"this swarm runs without link emulation (`up --no-emulation`): it cannot {what}")


def cmd_partition(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    _need_emulation(state, "cut links")
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
    _need_emulation(state, "restore links")
    for p in state.peers:
        if p.alive():
            peer_request(p, "emulate", {"heal": True})
    print("all emulated links restored", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Start a swarm, measure it, let one daemon schedule and hand out the tiny model, train it
    across the daemons, report, stop."""
    args.no_wait_measurements = False
    args.keep_on_failure = False
    args.log_json = False
    args.train = False
    cmd_up(args)
    run_dir: Path = args.run_dir
    try:
        state = load_state(run_dir)
        print(format_status(status_report(state)), flush=True)
        reply = _train(state, args)
        names = {p.peer_id: f"{p.name}({p.region})" for p in state.peers}
        print(f"\nallocation: {reply['stages']} stages x {reply['dp']} pipelines, layers "
              f"{reply['layer_ranges']}, predicted {reply['predicted_iteration_s']:.3f} s per step")
        for d, pipe in enumerate(reply["pipelines"]):
            print(f"  pipeline {d}: " + " -> ".join(names.get(p, p[:8]) for p in pipe))
        if reply["spares"]:
            print("  spares: " + ", ".join(names.get(p, p[:8]) for p in reply["spares"]))
        print(flush=True)
        shown = -1
        for step in range(args.steps):
            wait_step(state, run_dir, step, timeout_s=args.step_timeout)
            for row in read_log(run_dir / LOG_NAME):
                if row["step"] > shown:
                    print(_step_line(row), flush=True)
                    shown = row["step"]
        _demo_report(run_dir, reply)
    finally:
        cmd_down(argparse.Namespace(run_dir=run_dir, kill=False))
    return 0


def _step_line(row: dict) -> str:
    loss = "-" if row.get("loss") is None else f"{row['loss']:.4f}"
    tokens = "-" if row.get("tokens_per_s") is None else f"{row['tokens_per_s']:.0f}"
    term = "" if row.get("term") is None else f"  term {row['term']}"
    return f"step {row['step']:4d}  loss {loss}  {row.get('iteration_s', 0.0):.2f} s  {tokens} tokens/s{term}"


def _demo_report(run_dir: Path, reply: dict) -> None:
    rows = read_log(run_dir / LOG_NAME)
    measured = sorted(r["iteration_s"] for r in rows[1:]) or [float("nan")]
    median = measured[len(measured) // 2]
    lines = [f"allocation: {reply['stages']} x {reply['dp']}, pipelines "
             + "; ".join(" -> ".join(p[:8] for p in pipe) for pipe in reply["pipelines"]),
             f"loss: {rows[0]['loss']:.4f} at step 0 -> {rows[-1]['loss']:.4f} at step {rows[-1]['step']}",
             (f"iteration time: predicted {reply['predicted_iteration_s']:.3f} s, measured median "
             f"{median:.3f} s (first step left out)")]
    lines += format_reconfigurations(read_log(run_dir / EVENTS_NAME), current_run(run_dir).get("started_at"))
    plot = plot_loss(run_dir)
    lines.append(f"loss plot: {plot}" if plot else
                 "loss plot: install matplotlib (pip install matplotlib) and run the demo again for loss.png")
    (run_dir / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines) + f"\nreport: {run_dir / 'report.txt'}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run a scripted multi-region test swarm of dtfm peers on this machine, "
                    "with inter-region links emulated from a scenario file.",
        epilog="Exit status: 0 success, 1 an error explained on stderr, 2 bad command line, "
               "130 interrupted.")
    parser.add_argument("--version", action="version", version=version_text())
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
        p.add_argument("--time-scale", type=float, default=EmulationConfig().time_scale,
                       help="multiply every emulated delay by this (default: %(default)s)")
        p.add_argument("--bandwidth-scale", type=float, default=0.05,
                       help="multiply every emulated bandwidth by this, so loopback can carry "
                            "the scenario's links (default: %(default)s)")
        p.add_argument("--timeout", type=float, default=180.0,
                       help="seconds to wait for the swarm to converge (default: %(default)s)")

    def add_train_args(p: argparse.ArgumentParser, steps: int) -> None:
        p.add_argument("--preset", default=DEMO_PRESET, help="model preset (default: %(default)s)")
        p.add_argument("--steps", type=int, default=steps, help="training steps (default: %(default)s)")
        p.add_argument("--seed", type=int, default=0,
                       help="same seed, same losses, whatever the shape (default: %(default)s)")
        p.add_argument("--stages", type=int, default=None,
                       help="pipeline stages (default: the scheduler picks the shape)")
        p.add_argument("--dp", type=int, default=None, help="data-parallel pipelines (with --stages)")
        p.add_argument("--checkpoint-every", type=int, default=0,
                       help="each peer saves its stage every K steps (default: never)")
        p.add_argument("--placement", choices=PLACEMENTS, default="scheduler",
                       help="the DT-FM scheduler's allocation, or a random one of the --stages x --dp "
                            "shape as a baseline (default: %(default)s)")

    p = sub.add_parser("up", parents=[common], help="start a swarm and wait until it converges")
    add_up_args(p, 8)
    p.add_argument("--no-wait-measurements", action="store_true",
                   help="return once membership converged, before every link is measured")
    p.add_argument("--keep-on-failure", action="store_true",
                   help="leave the peers running when the swarm does not converge, to debug")
    p.add_argument("--log-json", action="store_true", help="peers log JSON lines")
    # test: every peer shares this machine, so the swarm runs the test profile's quick checks and
    # short timeouts (and the wan election where the emulated links are too slow for the lan one:
    # see dtfm.swarm.proc.plane_flags); wan or lan: the timings of a real deployment.
    p.add_argument("--plane-profile", choices=PLANE_PROFILES, default="test",
                   help="the peers' control plane timings (dtfm-peer join --plane-profile); the "
                        "election's are wan where emulated round trips exceed "
                        f"{LAN_ELECTION_MAX_RTT_MS:g} ms (default: %(default)s)")
    p.add_argument("--no-emulation", action="store_true",
                   help="plain loopback between the peers: no emulated delay or bandwidth; the "
                        "scenario only names their regions")
    p.add_argument("--train", action="store_true",
                   help="once every link is measured, start training on the swarm (see `train`)")
    add_train_args(p, steps=100)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("train", parents=[common],
                       help="start training on the running swarm: one daemon schedules, hands out "
                            "the allocation and starts every peer")
    add_train_args(p, steps=100)
    p.add_argument("--json", action="store_true", help="print the issuer's reply (the allocation) as JSON")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("wait", parents=[common],
                       help="wait until the swarm completed a training step; merges every "
                            "coordinator's train.jsonl and events.jsonl into the run dir")
    p.add_argument("--step", type=int, required=True, help="the step to wait for (0 is the first)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="give up after this many seconds (default: %(default)s)")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("status", parents=[common], help="one table of the whole swarm")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("events", parents=[common],
                       help="the run's events (coordinator elected, reconfigured, rolled back, stopped), "
                            "merged from every peer's data dir into the run dir's events.jsonl",
                       description="Print the events the coordinators wrote in their data dirs, merged, "
                                   "deduplicated and sorted by time, one a line: time, event, term, epoch, "
                                   "trigger, old -> new shape, predicted step times, moves, bytes moved, "
                                   "resume step.")
    p.add_argument("--json", action="store_true", help="print the merged events as a JSON list")
    p.set_defaults(func=cmd_events)

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
                       help="start a multi-region swarm, measure its links; one daemon schedules the "
                            "tiny model on the measurements and the daemons train it together; report, stop")
    add_up_args(p, 8)
    add_train_args(p, steps=30)
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="give up when one step takes longer than this (default: %(default)s)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SwarmError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dtfm-swarm status | head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
