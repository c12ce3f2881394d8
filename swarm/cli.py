"""`dtfm-swarm`: scripted multi-region test swarms on one machine.

Starts one `dtfm-peer join` process per peer on loopback, with regions assigned as a scenario
file says (scaled down to the requested count, keeping proportions) and every link emulated
inside the peers' transports (delay line + rate limiter per destination region). State lives in
a run directory so every subcommand works from any shell.

A run dir an earlier swarm used is refused unless `up` is told what to do with it (`--fresh`
deletes what the swarm wrote there, `--resume` restarts its peers with their identities and
runs); SIGTERM unwinds like Ctrl-C, through the clean-up that stops the peers a command started.

Exit status: 0 success, 1 an error explained on stderr (`dtfm-swarm: error: ...`), 2 bad
command line (any bad value), 130 interrupted, 143 terminated.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dtfm.cli_base import NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_SECONDS, number, run_command, version_text
from dtfm.control import DEVICE_RE, PLACEMENTS
from dtfm.net import IDENTITY_FILE, EmulationConfig, OperatorKey, new_swarm_key, operator_key_path, operator_line
from dtfm.peer import (
    KNOB_FLAGS,
    MAX_CLOCK_JUMP_S,
    PLANE_PROFILES,
    RUN_SPEC_KEYS,
    ConfigError,
    init_folder,
    load_run_spec,
    plural,
    resolve,
    start_request,
)
from dtfm.train import PRESETS
from dtfm.scenarios import ScenarioError, load_scenario

from .proc import (
    LAN_ELECTION_MAX_RTT_MS,
    free_ports,
    machine_compute_ms,
    peer_request,
    start_peer,
    stop_peer,
    stop_peers,
    wait_converged,
)
from .report import DEMO_PRESET, format_event, format_status, status_report
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
from .runreport import REPORT_NAME, write_report
from .train import EVENTS_NAME, LOG_NAME, RUN_NAME, START_TIMEOUT_S, read_log, start_training, sync_logs, wait_step

PROG = "dtfm-swarm"
MIN_PEERS, MAX_PEERS = 2, 256
FOREGROUND_POLL_S = 0.5
# What a swarm writes in its run dir besides the peers' data dirs (`up --fresh` deletes these).
RUN_FILES = (STATE_FILE, KEY_FILE, LOG_NAME, EVENTS_NAME, RUN_NAME, "report.txt", "loss.png")


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C, so the peers this command started are stopped."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


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
    n = args.peers if args.peers is not None else scenario.n_peers
    if not MIN_PEERS <= n <= MAX_PEERS:
        raise SwarmError(f"--peers must be between {MIN_PEERS} and {MAX_PEERS}, got {n} "
                         f"(the scenario's own count)")
    try:  # the peers' link emulator checks the scales; refuse them before starting any
        EmulationConfig(time_scale=args.time_scale, bandwidth_scale=args.bandwidth_scale)
    except ValueError as e:
        raise SwarmError(f"--time-scale / --bandwidth-scale: {e}") from None
    reuse_run_dir(run_dir, existing, fresh=args.fresh, resume=args.resume)
    small = scenario.scaled(n)
    scenario_ref = str(Path(args.scenario).resolve()) if Path(args.scenario).exists() else args.scenario
    ensure_run_dir(run_dir)
    key_file = run_dir / KEY_FILE
    # The swarm's one operator: `dtfm-swarm train` signs with its key, kept beside the swarm key.
    operator = OperatorKey.create(operator_key_path(key_file), replace=True)
    key_text = new_swarm_key() + "\n" + operator_line(operator.public_key) + "\n"
    write_secret_file(key_file, key_text.encode("ascii"))
    ports = free_ports(n)
    state = SwarmState(scenario=scenario_ref, scenario_name=scenario.name,
                       time_scale=args.time_scale, bandwidth_scale=args.bandwidth_scale,
                       emulated=not getattr(args, "no_emulation", False), plane_profile=args.plane_profile,
                       model_dirs=[str(d.resolve()) for d in getattr(args, "model_dir", [])],
                       device=getattr(args, "device", "cpu"))
    state.compute_ms = getattr(args, "compute_ms", 0.0) or machine_compute_ms(run_dir, state.device)
    state.layer_probe = getattr(args, "layer_probe", "measure")
    state.pipeline_schedule = getattr(args, "pipeline_schedule", "fitted")
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
    if not getattr(args, "foreground", False):
        if getattr(args, "train", False):
            _train(state, args)
        return 0
    try:
        if getattr(args, "train", False):
            _train(state, args)
        print("running in the foreground: Ctrl-C or SIGTERM stops every peer", file=sys.stderr)
        while any(p.alive() for p in state.peers):
            time.sleep(FOREGROUND_POLL_S)
        raise SwarmError(f"every peer exited: see their daemon.log and daemon.out (what a crash printed) in {run_dir}")
    finally:
        stop_peers(state.peers, graceful=True)
        save_state(run_dir, state)
        print(f"stopped the peers; logs stay in {run_dir}", file=sys.stderr)


def reuse_run_dir(run_dir: Path, existing: SwarmState | None, *, fresh: bool, resume: bool) -> None:
    """Refuse a run dir an earlier swarm used, unless told what to do with it: --fresh deletes
    what dtfm-swarm wrote there (peer data dirs, logs, state), --resume restarts the peers in
    their old data dirs (their identities, checkpoints and the runs they remember)."""
    used = used_files(run_dir, existing)
    if not used:
        return
    if resume:
        print(f"resuming in {run_dir}: the peers keep the identities and runs of its last swarm",
              file=sys.stderr)
        return
    if not fresh:
        what = ", ".join(p.name for p in used[:6]) + (", ..." if len(used) > 6 else "")
        raise SwarmError(f"{run_dir} holds an earlier swarm ({what}): pass --fresh to delete it "
                         f"and start anew, --resume to restart its peers with their identities "
                         f"and runs, or another --run-dir")
    for path in used:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    print(f"deleted the earlier swarm's files in {run_dir}", file=sys.stderr)


def used_files(run_dir: Path, existing: SwarmState | None) -> list[Path]:
    """What an earlier dtfm-swarm left in `run_dir`: its files, and the peer data dirs its state
    names (or that look like one: pNN/ with a daemon.log or an identity key)."""
    if not run_dir.is_dir():
        return []
    found = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    dirs = {Path(p.data_dir) for p in existing.peers} if existing is not None else set()
    dirs |= {d for d in run_dir.glob("p[0-9][0-9]*")
             if d.is_dir() and ((d / "daemon.log").exists() or (d / IDENTITY_FILE).exists())}
    found += sorted(d for d in dirs if d.exists() and d.parent.resolve() == run_dir.resolve())
    return found


def compression_arg(text: str) -> str:
    """`--compress NAME[,FIELD=VALUE...]` checked as `dtfm-peer train start` checks it; the
    canonical text of the config it names."""
    from dtfm.train import parse_compression  # (torch: only when the option is given)
    try:
        return parse_compression(text).to_spec()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _knob_type(kind: type, auto: bool) -> Callable[[str], int | float | str]:
    """An argparse type for a training knob of type `kind`, also taking "auto" where `auto` (the
    range is checked with the run spec's, `train_values`)."""
    if kind not in (int, float):
        return str

    def parse(text: str) -> int | float | str:
        if auto and text == "auto":
            return text
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}"
                                             + (' or "auto"' if auto else "") + f", got {text!r}") from None
    return parse


def _device_arg(text: str) -> str:
    if not DEVICE_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"choose cpu, cuda or cuda:N, not {text!r}")
    return text


def train_values(args: argparse.Namespace) -> dict:
    """The run `train`/`up --train`/`demo` asks for, as `dtfm-peer train start` resolves it:
    flags over the --spec file's keys over this command's defaults; ConfigError for a bad file,
    a bad combination or a model folder dtfm cannot compute. Sets args.preset and args.steps."""
    spec = load_run_spec(args.spec) if args.spec is not None else {}
    flags = {key: getattr(args, key, None) for key in RUN_SPEC_KEYS}
    values = resolve(flags, {"preset": DEMO_PRESET, "steps": args.default_steps, **spec})
    if values["stages"] == "auto" and values["dp"] is not None:
        raise ConfigError("--dp (dp) needs --stages S (stages)")
    if values["compress"] is not None:
        values["compress"] = compression_arg(values["compress"])
    for key in KNOB_FLAGS:
        RUN_SPEC_KEYS[key].check("--" + key.replace("_", "-"), values[key], None)
    values["init"] = init_folder(Path(values["init_from"])) if values["init_from"] is not None else None
    args.preset = values["preset"] if values["init"] is None else values["init"][1]
    args.steps = values["steps"]
    return values


def _train_request(args: argparse.Namespace) -> dict:
    values = args.run_values
    out = start_request(values)
    if values["init"] is not None:
        out.update(init_from=values["init"][0], init_name=values["init"][1])
    return out


def _train(state: SwarmState, args: argparse.Namespace) -> dict:
    """`train start` on the first live peer: it schedules, hands out and starts the run."""
    peer = next((p for p in state.peers if p.alive()), None)
    if peer is None:
        raise SwarmError("no peer is running")
    reply = start_training(state, peer, _train_request(args), run_dir=args.run_dir, timeout_s=args.start_timeout)
    print(format_train_started(args.preset, reply, peer.name), file=sys.stderr)
    return reply


def format_train_started(preset: str, reply: dict, issuer: str) -> str:
    """The line `train start` prints: the run's length and shape, its issuer, the predicted step
    time and, when gradients are compressed, the compression."""
    return (f"training {preset} for {reply['steps']} steps as {plural(reply['stages'], 'stage')} x "
            f"{plural(reply['dp'], 'pipeline')}, issued by {issuer}; predicted "
            f"{reply['predicted_iteration_s']:.3f} s per step"
            + (f"; compression {reply['compression']}" if reply.get("compression", "exact") != "exact" else "")
            + (f"\nshape: {reply['shape_note']}" if reply.get("shape_note") else ""))


def cmd_train(args: argparse.Namespace) -> int:
    reply = _train(load_state(args.run_dir), args)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    if args.step == 0:  # nothing to wait for: the logs are merged into the run dir
        sync_logs(args.run_dir, state)
        print(f"log in {args.run_dir / LOG_NAME}", file=sys.stderr)
        return 0
    last = wait_step(state, args.run_dir, args.step - 1, args.timeout)
    print(f"step {last['step'] + 1} completed; log in {args.run_dir / LOG_NAME}", file=sys.stderr)
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
    stop_peers(state.peers, graceful=not args.kill)  # a peer killed earlier is only reaped
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


def cmd_clock_jump(args: argparse.Namespace) -> int:
    state = load_state(args.run_dir)
    _need_emulation(state, "move a peer's clock")
    peers = _select(state, args.peer)
    for p in peers:
        peer_request(p, "emulate", {"clock_jump_s": args.seconds})
    names = ", ".join(p.name for p in peers)
    print(f"wall clock of {names} {'moved by ' + format(args.seconds, '+g') + ' s' if args.seconds else 'restored'} "
          "(the times it signs; its timers run on)", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Start a swarm, measure it, let one daemon schedule and hand out the tiny model, train it
    across the daemons, report, stop."""
    args.no_wait_measurements = False
    args.keep_on_failure = False
    args.fresh, args.resume, args.foreground = True, False, False
    args.log_json = False
    args.train = False
    cmd_up(args)
    run_dir: Path = args.run_dir
    try:
        state = load_state(run_dir)
        print(format_status(status_report(state)), flush=True)
        reply = _train(state, args)
        names = {p.peer_id: f"{p.name}({p.region})" for p in state.peers}
        print(f"\nallocation: {plural(reply['stages'], 'stage')} x {plural(reply['dp'], 'pipeline')}, layers "
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
        sync_logs(run_dir, state)
        print("\n" + "\n".join(write_report(run_dir)) + f"\nreport: {run_dir / REPORT_NAME}", flush=True)
    finally:
        cmd_down(argparse.Namespace(run_dir=run_dir, kill=False))
    return 0


def _step_line(row: dict) -> str:
    loss = "-" if row.get("loss") is None else f"{row['loss']:.4f}"
    tokens = "-" if row.get("tokens_per_s") is None else f"{row['tokens_per_s']:.0f}"
    term = "" if row.get("term") is None else f"  term {row['term']}"
    return f"step {row['step'] + 1:4d}  loss {loss}  {row.get('iteration_s', 0.0):.2f} s  {tokens} tokens/s{term}"


def cmd_report(args: argparse.Namespace) -> int:
    """report.txt and loss.png from the run dir (merging the peers' logs first where their data
    dirs are readable), printed too."""
    run_dir: Path = args.run_dir
    try:
        sync_logs(run_dir, load_state(run_dir))
    except SwarmError:
        pass  # a copied run dir without swarm.json: report what is there
    lines = write_report(run_dir)
    print("\n".join(lines) + f"\nreport: {run_dir / REPORT_NAME}", flush=True)
    return 0


POSITIVE_SCALE = number(float, 1e-9, "a positive number")
PEER_COUNT = number(int, MIN_PEERS, f"a peer count from {MIN_PEERS} to {MAX_PEERS}", MAX_PEERS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run a scripted multi-region test swarm of dtfm peers on this machine, "
                    "with inter-region links emulated from a scenario file.",
        epilog="Exit status: 0 success, 1 an error explained on stderr, 2 bad command line, "
               "130 interrupted, 143 terminated (SIGTERM).")
    parser.add_argument("--version", action="version", version=version_text())
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", type=Path, default=default_run_dir(), metavar="DIR",
                        help="where the swarm keeps its state, keys, logs and peer data dirs "
                             "(default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help, description=description)

    def add_up_args(p: argparse.ArgumentParser, peers_default: int | None) -> None:
        p.add_argument("--scenario", default="worldwide", metavar="NAME|FILE",
                       help="built-in scenario name (datacenter, spot, universities, regional, "
                            "worldwide) or a scenario TOML file (default: %(default)s)")
        p.add_argument("--peers", type=PEER_COUNT, default=peers_default, metavar="N",
                       help=f"number of peers, {MIN_PEERS} to {MAX_PEERS}; regions keep the scenario's "
                            "proportions (default: %(default)s)")
        p.add_argument("--time-scale", type=POSITIVE_SCALE, default=EmulationConfig().time_scale,
                       metavar="X",
                       help="multiply every emulated delay by X and divide every emulated bandwidth "
                            "by it (default: %(default)s)")
        p.add_argument("--bandwidth-scale", type=POSITIVE_SCALE, default=0.05, metavar="X",
                       help="multiply every emulated bandwidth by X, so loopback can carry "
                            "the scenario's links (default: %(default)s)")
        p.add_argument("--timeout", type=POSITIVE_SECONDS, default=180.0, metavar="SECONDS",
                       help="how long to wait for the swarm to converge (default: %(default)s)")
        # test: every peer shares this machine, so the swarm runs the test profile's quick checks and
        # short timeouts (and the wan election where the emulated links are too slow for the lan one:
        # see dtfm.swarm.proc.plane_flags); wan or lan: the timings of a real deployment.
        p.add_argument("--plane-profile", choices=PLANE_PROFILES, default="test",
                       help="the peers' control plane timings (dtfm-peer join --plane-profile); the "
                            "election's are wan where emulated round trips exceed "
                            f"{LAN_ELECTION_MAX_RTT_MS:g} ms (default: %(default)s)")

    def add_train_args(p: argparse.ArgumentParser, steps: int) -> None:
        p.set_defaults(default_steps=steps, subparser=p)
        p.add_argument("--start-timeout", type=POSITIVE_SECONDS, default=START_TIMEOUT_S, metavar="SECONDS",
                       help="how long the start may take: the scheduler, the hand-out and every placed "
                            "peer building its stage (a large swarm on few cores needs more; "
                            "default: %(default)s)")
        p.add_argument("--spec", type=Path, default=None, metavar="FILE",
                       help="a run spec TOML file, as `dtfm-peer train start --spec` reads it; a flag given "
                            "here wins over its key")
        p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                       help=f"model preset of python -m dtfm.train (default: {DEMO_PRESET})")
        p.add_argument("--init-from", type=Path, default=None, metavar="DIR",
                       help="start from a Hugging Face GPT-2-family folder instead of a preset; every peer "
                            "must hold it (`up --model-dir DIR`)")
        p.add_argument("--steps", type=POSITIVE_INT, default=None, metavar="N",
                       help=f"training steps (default: {steps})")
        p.add_argument("--seed", type=NON_NEGATIVE_INT, default=None, metavar="N",
                       help="same seed, same losses, whatever the shape (default: 0)")
        p.add_argument("--stages", type=POSITIVE_INT, default=None, metavar="S",
                       help="pipeline stages (default: the scheduler picks the shape)")
        p.add_argument("--dp", type=POSITIVE_INT, default=None, metavar="D",
                       help="data-parallel pipelines (with --stages; default: the scheduler picks the count, "
                            "spares allowed; a random placement: as many as the peers fill)")
        p.add_argument("--checkpoint-every", type=NON_NEGATIVE_INT, default=None, metavar="K",
                       help="each peer saves its stage every K steps and where the run ends; 0: only "
                            "where it ends (default: 20)")
        p.add_argument("--placement", choices=PLACEMENTS, default=None,
                       help="the DT-FM scheduler's allocation, or a random one of the --stages x --dp "
                            "shape as a baseline (default: scheduler)")
        p.add_argument("--compress", type=compression_arg, default=None, metavar="NAME[,FIELD=VALUE...]",
                       help="compression of activations and DP synchronisation, as `dtfm-peer train start "
                            "--compress` takes it, e.g. slow-link or diloco,inner_steps=8 (docs/compression.md; "
                            "default: exact)")
        knobs = p.add_argument_group("training config, as `dtfm-peer train start` takes it")
        for key, text in KNOB_FLAGS.items():
            k = RUN_SPEC_KEYS[key]
            knobs.add_argument("--" + key.replace("_", "-"), type=_knob_type(k.kind, k.auto), default=None, choices=k.choices or None,
                               metavar=None if k.choices else ("N|auto" if k.auto else "N" if k.kind is int else "X"),
                               help=f"{text} (default: {k.default})")

    def add_reuse_args(p: argparse.ArgumentParser) -> None:
        reuse = p.add_mutually_exclusive_group()
        reuse.add_argument("--fresh", action="store_true",
                           help="delete an earlier swarm's files in the run dir (peer data dirs, "
                                "logs, state) and start anew")
        reuse.add_argument("--resume", action="store_true",
                           help="restart an earlier swarm's peers in their data dirs: their "
                                "identities, checkpoints and the runs they remember")

    p = command("up", "start a swarm and wait until it converges",
                "Start one `dtfm-peer join` daemon per peer on loopback, regions as the scenario "
                "says, every inter-region link emulated, and wait until every peer sees every "
                "other (and, unless --no-wait-measurements, has measured every link). The daemons "
                "keep running after `up` returns (`dtfm-swarm down` stops them), or with "
                "--foreground until `up` is interrupted (Ctrl-C, SIGTERM). A run dir an earlier "
                "swarm used needs --fresh or --resume.")
    add_up_args(p, 8)
    add_reuse_args(p)
    p.add_argument("--foreground", action="store_true",
                   help="stay in the foreground once the swarm is up; Ctrl-C or SIGTERM stops every peer")
    p.add_argument("--no-wait-measurements", action="store_true",
                   help="return once membership converged, before every link is measured")
    p.add_argument("--keep-on-failure", action="store_true",
                   help="leave the peers running when the swarm does not converge, to debug")
    p.add_argument("--log-json", action="store_true", help="peers log JSON lines")
    p.add_argument("--no-emulation", action="store_true",
                   help="plain loopback between the peers: no emulated delay or bandwidth; the "
                        "scenario only names their regions")
    p.add_argument("--train", action="store_true",
                   help="once every link is measured, start training on the swarm (see `train`)")
    p.add_argument("--model-dir", type=Path, action="append", default=[], metavar="DIR",
                   help="a Hugging Face GPT-2-family folder every peer may start a run from "
                        "(`dtfm-peer join --model-dir`); repeatable")
    p.add_argument("--device", default="cpu", type=_device_arg, metavar="DEVICE",
                   help="every peer's `join --device`: build and train the stages on cpu, cuda or cuda:N; "
                        "the peers of one machine share its GPU (default: %(default)s)")
    p.add_argument("--compute-ms", type=number(float, 0.0, "a non-negative number of ms"), default=0.0, metavar="MS",
                   help="the compute figure every peer reports from its start (ms of one reference "
                        "transformer block, see `dtfm-peer join --compute-ms`); 0 measures this machine "
                        "once and keeps the figure in the run dir (default); a peer that trains reports "
                        "what its own steps measure instead")
    p.add_argument("--layer-probe", choices=("measure", "off"), default="measure",
                   help="every peer's `dtfm-peer join --layer-probe`: measure (the coordinator times the "
                        "run's layer and this machine at a start, for the scheduler's shape and its "
                        "prediction) or off (every layer costed at the reference rate from --compute-ms: "
                        "quicker starts where the runs fix their shapes, as the tests' do) "
                        "(default: %(default)s)")
    p.add_argument("--pipeline-schedule", choices=("fitted", "gpipe"), default="fitted",
                   help="every peer's `dtfm-peer join --pipeline-schedule`: the stages' order of forwards and "
                        "backwards the coordinator hands out, fitted (1F1B with warm-ups fitted to the links, "
                        "or GPipe where that is as fast) or gpipe (every forward first, the paper's) "
                        "(default: %(default)s)")
    add_train_args(p, steps=100)
    p.set_defaults(func=cmd_up)

    p = command("train", "start training on the running swarm",
                "Start training on the running swarm: the first live daemon schedules the live "
                "peers on its measured view, hands out the allocation and starts every peer. "
                "`dtfm-swarm wait` follows the run; `dtfm-swarm report` draws it.")
    add_train_args(p, steps=100)
    p.add_argument("--json", action="store_true", help="print the issuer's reply (the allocation) as JSON")
    p.set_defaults(func=cmd_train)

    p = command("wait", "wait until the swarm completed a training step",
                "Wait until the swarm completed a training step; merges every coordinator's "
                "step log (train.jsonl) and events.jsonl into the run dir's as it goes. Fails when "
                "the run ends before the step.")
    p.add_argument("--step", type=NON_NEGATIVE_INT, required=True, metavar="N",
                   help="the step to wait for, counted from 1 as the step lines count them "
                        "(--step 30: until 30 steps are done; 0 merges the logs and returns)")
    p.add_argument("--timeout", type=POSITIVE_SECONDS, default=600.0, metavar="SECONDS",
                   help="give up after this many seconds (default: %(default)s)")
    p.set_defaults(func=cmd_wait)

    p = command("status", "one table of the whole swarm",
                "One table of the whole swarm: each peer's region, name (* marks the "
                "coordinator), id, election role and term, STAGE/PIPELINE in the run, epoch, "
                "last step, process and gossip state; then the measured delay and bandwidth "
                "between every two peers in the scenario's units.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = command("events", "the run's events, merged from every peer's data dir",
                "Print the events the coordinators wrote in their data dirs, merged, "
                "deduplicated and sorted by time, one a line: time, event, term, epoch, "
                "trigger, old -> new shape, predicted step times, moves, bytes moved, "
                "resume step.")
    p.add_argument("--json", action="store_true", help="print the merged events as a JSON list")
    p.set_defaults(func=cmd_events)

    p = command("report", "write report.txt and loss.png from the run dir, without running again",
                "Redraw a run from its run dir: merges the peers' logs when their data dirs are "
                "there, then writes report.txt (scenario, peers and their regions, seed, "
                "allocation, loss, tokens/s, iteration time, total time, reconfigurations) and "
                "loss.png (loss and tokens/s per step, reconfigurations marked). Works on a "
                "stopped swarm and on a copied run dir.")
    p.set_defaults(func=cmd_report)

    p = command("kill", "signal one peer (SIGKILL by default)",
                "Send a signal to one peer's daemon: KILL (the default) to test failure handling, "
                "TERM for a clean leave, STOP/CONT to freeze it.")
    p.add_argument("peer", help="peer name (p03), index, or peer-id prefix")
    p.add_argument("--signal", default="KILL", metavar="NAME", help="signal name (default: %(default)s)")
    p.set_defaults(func=cmd_kill)

    p = command("restart", "stop one peer if running and start it again with its data dir",
                "Stop one peer if it runs and start it again with the same data dir (identity, "
                "checkpoints), address and region.")
    p.add_argument("peer", help="peer name (p03), index, or peer-id prefix")
    p.add_argument("--log-json", action="store_true", help="the peer logs JSON lines")
    p.set_defaults(func=cmd_restart)

    p = command("down", "stop every peer (gracefully by default)",
                "Stop every peer: each is asked to leave (SIGKILL after a grace period, or at "
                "once with --kill). The run dir keeps the logs and data dirs.")
    p.add_argument("--kill", action="store_true", help="SIGKILL instead of a graceful leave")
    p.set_defaults(func=cmd_down)

    p = command("partition", "cut the emulated links between two regions or peers",
                "Cut the emulated links between two sides, each a region name or one peer; "
                "`heal` restores them.")
    p.add_argument("a", help="region name, or one peer")
    p.add_argument("b", help="region name, or one peer")
    p.add_argument("--one-way", action="store_true", help="cut only the direction a -> b")
    p.set_defaults(func=cmd_partition)

    p = command("heal", "restore every cut link", "Restore every emulated link `partition` cut.")
    p.set_defaults(func=cmd_heal)

    p = command("clock-jump", "move a peer's wall clock",
                "Move the wall clock of a peer (or of every peer of a region) by SECONDS, as NTP "
                "stepping it or a resumed virtual machine would: the times it signs (gossip records, "
                "its clock in votes and operations) move, its timers do not. 0 restores it.")
    p.add_argument("peer", help="region name, or one peer")
    p.add_argument("seconds", type=number(float, -MAX_CLOCK_JUMP_S, "a number of seconds within a year either way",
                                          MAX_CLOCK_JUMP_S),
                   help="how far, either way (negative: back)")
    p.set_defaults(func=cmd_clock_jump)

    p = command("demo", "start a swarm, measure it, train the tiny model on it, report, stop",
                "Start a multi-region swarm and measure its links; one daemon schedules the tiny "
                "model on the measurements and the daemons train it together; write report.txt "
                "and loss.png; stop. The demo always starts clean: it deletes an earlier swarm's "
                "files in the run dir (see `up --fresh`).")
    add_up_args(p, 8)
    add_train_args(p, steps=30)
    p.add_argument("--step-timeout", type=POSITIVE_SECONDS, default=300.0, metavar="SECONDS",
                   help="give up when one step takes longer than this (default: %(default)s)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "default_steps"):  # a command that starts training: its run spec, checked now
        try:
            args.run_values = train_values(args)
        except (ConfigError, argparse.ArgumentTypeError) as e:
            args.subparser.error(str(e))  # exits 2, with the usage
    # SIGTERM unwinds like Ctrl-C, through the clean-up that stops the peers started here
    # (only the main thread may set a handler: a caller's thread keeps the default)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return run_command(PROG, lambda: args.func(args), user_errors=(SwarmError,), say_interrupted=True)
    except Terminated:
        print(f"{PROG}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
