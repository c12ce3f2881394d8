"""`dtfm-peer`: run a swarm peer and talk to it.

    dtfm-peer keygen                      create this machine's identity key
    dtfm-peer swarm-key new --out FILE    make a secret that defines a swarm (file mode 0600), and
                                          its operator key FILE.operator
    dtfm-peer operator-key new --out FILE make another operator's key
    dtfm-peer join --swarm-key FILE ...   run the daemon in the foreground
    dtfm-peer status [--json]             ask the running daemon how it is doing
    dtfm-peer members [--json]            list every member of the swarm with its role and state
    dtfm-peer leave                       hand the daemon's part of a run off, leave and exit
    dtfm-peer train start|stop ...        train a model on the swarm, or end the run
    dtfm-peer train reschedule            ask the coordinator for a new allocation now
    dtfm-peer train resume [RUN]          continue a stopped run from the newest step every stage
                                          is held at (in memory or in a checkpoint)
    dtfm-peer train status [--follow]     the run's progress from its coordinator, on any daemon
    dtfm-peer export [RUN] --out DIR      gather a run's model from its peers into one folder
                                          (each signed with the operator key)

Exit status (dtfm.cli_base, as for every dtfm command): 0 success, 1 an error explained on
stderr, 2 bad command line, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from dtfm.files import atomic_write
from dtfm.cli_base import POSITIVE_INT, POSITIVE_SECONDS, CliError, run_command, version_text
from dtfm.cli_base import user_error_text as _user_error_text
from dtfm.train import PRESETS
from dtfm.net import (
    IDENTITY_FILE,
    Identity,
    KeyFileError,
    OperatorKey,
    new_swarm_key,
    operator_key_path,
    operator_line,
)

from . import logs
from .config import ConfigError, DaemonConfig, ListenError
from .paths import DataDir, DataDirError, DataDirLock, default_data_dir
from .settings import apply_flags, default_text, flag_settings, load_toml
from .control_client import ControlClient, ControlClientError, ControlSocketError, DaemonNotRunning
from .members import format_members, member_rows
from .runspec import (KNOB_FLAGS, PLACEMENT_CHOICES, RUN_SPEC_KEYS, init_folder, load_run_spec, resolve, send_start,
                      start_request)
from .status import format_resume, format_status_text, plural, reconfiguration_parts, to_json

PROG = "dtfm-peer"
# The signed start's names of the training knobs (TrainConfig fields), for the start's summary.
TRAIN_KNOBS = frozenset(RUN_SPEC_KEYS[k].arg or k for k in KNOB_FLAGS)
USER_ERRORS = (ConfigError, DataDirError, KeyFileError, DaemonNotRunning, ControlClientError,
               ListenError, ControlSocketError)


# ---- argument parsing -------------------------------------------------------------------------

def _add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, metavar="DIR",
                   help="the peer's data directory (default: $DTFM_DATA_DIR, else $XDG_DATA_HOME/dtfm or "
                        "~/.local/share/dtfm)")


def _add_operator_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--operator-key", type=Path, metavar="FILE",
                   help="the operator key that signs the operation (default: the one beside the daemon's "
                        "swarm key file, SWARM_KEY_FILE.operator)")


def _add_config_file(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--config", type=Path, metavar="FILE", help=text)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per setting that declares one; help and default come from the setting."""
    for s in flag_settings():
        if s.flag is None:  # (flag_settings yields only the settings that declare a flag)
            continue
        kwargs: dict = {"dest": s.dest, "default": None, "help": s.help + default_text(s)}
        if s.hint is bool:
            kwargs.update(action="store_const", const=True)
        else:
            kwargs["metavar"] = s.metavar
            if s.repeat:
                kwargs["action"] = "append"
        p.add_argument(s.flag, **kwargs)


def _add_signer_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a command that signs an operation with the operator key: where the daemon is
    and which key signs."""
    _add_data_dir(p)
    _add_operator_key(p)
    _add_config_file(p, "the daemon's TOML configuration file, to find its data dir (--data-dir wins)")


def _add_signed_parser(sub, name: str, help: str, description: str, *,
                       first: Callable[[argparse.ArgumentParser], None] | None = None,
                       timeout_s: float | None = None, timeout_help: str = "", json_help: str = ""
                       ) -> argparse.ArgumentParser:
    """The parser of a command that signs an operation and sends it to the daemon: `first`
    adds its own arguments, then the signer's flags, then --timeout SECONDS (default
    `timeout_s`, `timeout_help` saying what it waits for) and --json (`json_help`) where given."""
    p = sub.add_parser(name, help=help, description=description)
    if first is not None:
        first(p)
    _add_signer_flags(p)
    if timeout_s is not None:
        p.add_argument("--timeout", type=POSITIVE_SECONDS, default=timeout_s, metavar="SECONDS",
                       help=f"{timeout_help} (default: %(default)s)")
    if json_help:
        p.add_argument("--json", action="store_true", help=json_help)
    return p


def _add_run_arg(default_text: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("run", nargs="?", default=None, metavar="RUN",
                       help=f"the run id, or a prefix of it (default: {default_text})")
    return add


def _add_council_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--voters", type=_council_ids, default=None, metavar="ID,ID,...",
                   help="the peer ids of the new council (at most --council-size of them; default: the daemon's "
                        "proposal of live, measured peers spread over the regions)")
    p.add_argument("--council-size", type=int, choices=(3, 5, 7), default=None,
                   help="the size the council keeps itself at (default: the daemon's [plane] council_size)")


def _add_export_args(p: argparse.ArgumentParser) -> None:
    _add_run_arg("this peer's last run")(p)
    p.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help="the folder to write; written under a temporary name beside it, then renamed")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run a dtfm swarm peer: a daemon that joins a private swarm of machines "
                    "training one model together, and commands to inspect and stop it.",
        epilog="Typical first run: `dtfm-peer swarm-key new --out swarm.key` on one machine, copy "
               "swarm.key to the others, then on each: `dtfm-peer join --swarm-key swarm.key "
               "--listen 0.0.0.0:7450 --bootstrap FIRST_HOST:7450`; then `dtfm-peer train start` "
               "where swarm.key.operator is, and `dtfm-peer train status --follow` on any of them.")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("keygen", help="create this peer's identity key (once per data dir)",
                       description="Create an Ed25519 identity key in the data directory "
                                   "(file mode 0600) and print the peer id. If the key exists "
                                   "it is kept and its peer id printed.")
    _add_data_dir(p)
    p.add_argument("--json", action="store_true", help="print the peer id as JSON")

    p = sub.add_parser("swarm-key", help="make a swarm key",
                       description="A swarm key is a shared 32-byte secret: only peers holding "
                                   "it can join the swarm. Keep it like a password.")
    sk = p.add_subparsers(dest="swarm_key_command", metavar="ACTION", required=True)
    p = sk.add_parser("new", help="make a new random swarm key and its operator key",
                      description="Make a new random swarm key: `dtfm-peer swarm-key new --out "
                                  "swarm.key` writes it readable by you only (mode 0600), with a new "
                                  "operator key beside it, swarm.key.operator (mode 0600), whose public "
                                  "key swarm.key names: only that key's holder starts, stops and "
                                  "reschedules training. Copy swarm.key to every peer; keep "
                                  "swarm.key.operator where you run `dtfm-peer train`. Without --out the "
                                  "swarm key is printed, with no operator.")
    p.add_argument("--out", type=Path, metavar="FILE",
                   help="write the key to FILE and the operator key to FILE.operator (mode 0600) "
                        "instead of printing it; existing files are kept unless --force")
    p.add_argument("--force", action="store_true", help="with --out, replace existing files")

    p = sub.add_parser("operator-key", help="make an operator key",
                       description="An operator key signs `dtfm-peer train start|stop|resume|reschedule` and `dtfm-peer export`. "
                                   "A swarm takes them from the operators its swarm key file names.")
    ok = p.add_subparsers(dest="operator_key_command", metavar="ACTION", required=True)
    p = ok.add_parser("new", help="make a new operator key (for another operator of a swarm)",
                      description="Write a new operator key to FILE (mode 0600) and print the line that "
                                  "names it as an operator: append that line to the swarm key file on "
                                  "every peer and restart them, then sign with `dtfm-peer train ... "
                                  "--operator-key FILE`.")
    p.add_argument("--out", type=Path, metavar="FILE", required=True, help="where to write the key (mode 0600)")
    p.add_argument("--force", action="store_true", help="replace an existing FILE")

    p = sub.add_parser("join", help="run the peer daemon in the foreground",
                       description="Join the swarm: listen for peers, connect to the bootstrap "
                                   "peers, find the rest, and serve the control socket until "
                                   "SIGINT/SIGTERM or `dtfm-peer leave`; then tell the peers and "
                                   "exit 0. Creates the identity key if the data dir has none.")
    _add_config_file(p, "TOML configuration file (see docs/daemon.md); flags override it")
    _add_config_flags(p)
    p.set_defaults(subparser=p)  # a flag value the settings refuse is a usage error (exit 2)

    for name, text, more in (
            ("status", "show the running daemon's status", ""),
            ("members", "list every member of the swarm the running daemon knows",
             " Each with its role in the run (coordinator, voter, stage, spare), its stage and pipeline, "
             "region, address and gossip state (alive, suspect, unconfirmed, dead, left), as the "
             "local daemon knows them."),
            ("leave", "make the running daemon leave the swarm and exit",
             " A peer of a training run first asks the coordinator to hand its part off: the run is "
             "reconfigured without it at a step boundary, its stages fetched from its memory; then "
             "gossip is told it left (not failed). If the coordinator does not answer in time "
             "(plane.leave_hand_off_s), it leaves anyway and the run treats it as failed.")):
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + "." + more)
        _add_data_dir(p)
        _add_config_file(p, "the daemon's TOML configuration file, to find its data dir "
                            "(--data-dir wins)")
        if name in ("status", "members"):
            p.add_argument("--json", action="store_true",
                           help="print the full status as JSON (ids in full)" if name == "status" else
                           "print the members as JSON (ids in full)")
        else:
            p.add_argument("--no-wait", action="store_true",
                           help="return once the daemon accepted, without waiting for it "
                                "to exit")
            p.add_argument("--timeout", type=POSITIVE_SECONDS, default=180.0, metavar="SECONDS",
                           help="how long to wait for the daemon to hand its part off and exit "
                                "(default: 180)")
    p = sub.add_parser("train", help="start, follow, stop, resume or reschedule training on the swarm",
                       description="Start training on the swarm from this daemon, follow the run's progress, "
                                   "stop the run, resume a stopped run, or ask its coordinator for a new "
                                   "allocation now.")
    tsub = p.add_subparsers(dest="train_command", required=True, metavar="ACTION")
    text = ("schedule the live peers on the measured network and train: the coordinator runs the "
            "DT-FM scheduler on its gossiped view, signs the allocation, hands it to every peer "
            "and starts them once all accepted. Every peer trains on the data it was started "
            "with (`join --data`); the start names this daemon's by its hash, and a peer that "
            "holds other data refuses the run")
    t = tsub.add_parser("start", help=text.split(":")[0], description=text[0].upper() + text[1:] + ".")
    _add_signer_flags(t)
    t.set_defaults(subparser=t)  # a bad run spec is a usage error (exit 2)
    t.add_argument("--spec", type=Path, default=None, metavar="FILE",
                   help="a run spec: a TOML file whose keys are these flags' names with underscores "
                        "(preset, steps, lr, batch, ...; docs/train.md); a flag given here wins over its key")
    t.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="model preset (default: tiny)")
    t.add_argument("--init-from", type=Path, default=None, metavar="DIR",
                   help="start from the weights of a Hugging Face GPT-2-family folder (config.json, "
                        "model.safetensors; its shape replaces --preset); the start names it by digest and "
                        "every peer must hold a copy (`join --model-dir DIR`)")
    t.add_argument("--steps", type=_spec_arg("steps"), default=None, help="steps to train (default: 100)")
    t.add_argument("--seed", type=_spec_arg("seed"), default=None,
                   help="seeds the weights and the data order; the same seed gives the same losses "
                        "whatever the shape (default: 0)")
    t.add_argument("--stages", type=_stages, default=None, metavar="S|auto",
                   help="pipeline stages; auto lets the scheduler pick the shape (default: auto)")
    t.add_argument("--dp", type=_spec_arg("dp"), default=None, metavar="D",
                   help="data-parallel pipelines (with --stages S; default: the scheduler picks the count "
                        "fastest to the run's target loss, peers left out as spares if that is faster; a "
                        "random placement: as many as the live peers fill)")
    t.add_argument("--checkpoint-every", type=_spec_arg("checkpoint_every"), default=None, metavar="K",
                   help="every peer saves its stage in its data dir every K steps, and where the run "
                        "ends (its last step or `train stop`); 0: only there (default: 20)")
    t.add_argument("--placement", choices=PLACEMENT_CHOICES, default=None,
                   help="who runs what: the DT-FM scheduler on the measured view, or a random "
                        "allocation of the --stages x --dp shape, as a baseline (default: scheduler)")
    t.add_argument("--compress", type=compression_arg, default=None, metavar="NAME[,FIELD=VALUE...]",
                   help="compress activations and/or data-parallel synchronisation: a preset (exact, "
                        "pp-int8, pp-int4, cocktail, diloco, slow-link) with fields of its config changed "
                        "after commas, e.g. diloco,inner_steps=8; slow-link is the choice for slow links "
                        "(docs/compression.md) (default: exact, the 1e-5 oracle's full-width tensors)")
    t.add_argument("--min-peers", type=_spec_arg("min_peers"), default=None, metavar="N",
                   help="wait until N peers (this one included) are live and their links measured, "
                        "then form the first configuration and schedule them; gives up after "
                        "--timeout (default: 1, start at once)")
    knobs = t.add_argument_group("training config (dtfm.train.TrainConfig; every peer applies the same)")
    for key, text in KNOB_FLAGS.items():
        k = RUN_SPEC_KEYS[key]
        knobs.add_argument("--" + key.replace("_", "-"), type=_spec_arg(key), default=None,
                           choices=k.choices or None,
                           metavar=None if k.choices else ("N|auto" if k.auto else "N" if k.kind is int else "X"),
                           help=f"{text} (default: {k.default})")
    t.add_argument("--timeout", type=POSITIVE_SECONDS, default=300.0, metavar="SECONDS",
                   help="how long to wait for --min-peers and for every peer to accept "
                        "(default: %(default)s)")
    t.add_argument("--json", action="store_true", help="print the allocation as JSON")
    _add_signed_parser(tsub, "stop", "end the run at the next step boundary on every peer",
                       "End the run this daemon takes part in, on the same step boundary on every "
                       "peer: the coordinator tells them, with your signed stop. Prints the step the "
                       "run stops after and how many peers were told.",
                       timeout_s=60.0, timeout_help="how long to wait for the coordinator's answer",
                       json_help="print the coordinator's answer as JSON")
    _add_signed_parser(tsub, "resume", "continue a stopped run from the newest step every stage is held at",
                       "Continue a run that `train stop` ended (the swarm's last run), as a new epoch of "
                       "the same run with its own parameters, from the newest step at which every stage "
                       "is held by a live peer, in memory or in a checkpoint. Refused, with the reason, "
                       "for another run, a run still running or finished, or when some stage is held by "
                       "no live peer.",
                       first=_add_run_arg("the swarm's last run"), timeout_s=300.0,
                       timeout_help="how long to wait for the run to be handed out again",
                       json_help="print the coordinator's answer as JSON")
    _add_signed_parser(tsub, "council", "re-root the election's council (when it lost its quorum)",
                       "Name a new council of voters, signed with your operator key: every live peer takes "
                       "it over the council it holds (one the operator rooted earlier), and the new council "
                       "elects a coordinator. For a swarm whose council lost its quorum (most of its voters "
                       "gone for good); a council that lost one voter replaces it by itself. Without "
                       "--voters, the daemon proposes live, measured peers spread over the regions.",
                       first=_add_council_args,
                       timeout_s=60.0, timeout_help="how long to wait for the daemon's answer",
                       json_help="print the daemon's answer as JSON")
    t = tsub.add_parser("status", help="the run's progress from its coordinator; --follow streams it",
                        description="Show the run's progress as its coordinator tells it, on any daemon "
                                    "of the run (this daemon asks the coordinator): state, term, epoch, "
                                    "shape, steps done, tokens/s and ETA, the last steps (loss, step "
                                    "time, tokens/s, epoch) and reconfigurations. --follow prints each "
                                    "new step and reconfiguration as it comes, until the run ends (Ctrl-C "
                                    "stops following; the run goes on).")
    t.add_argument("run", nargs="?", default=None, metavar="RUN", type=_run_id,
                   help="the run id (32 hex digits; default: the coordinator's run)")
    t.add_argument("--follow", "-f", action="store_true", help="keep printing new steps until the run ends")
    t.add_argument("--json", action="store_true",
                   help="print the answer as one JSON object; with --follow, one JSON object per line, its "
                        "`record` saying what it is: run (the header), step, reconfiguration, end (the last)")
    _add_data_dir(t)
    _add_config_file(t, "the daemon's TOML configuration file, to find its data dir (--data-dir wins)")
    _add_signed_parser(tsub, "reschedule", "ask the coordinator for a new allocation now",
                       "Ask the run's coordinator for a new allocation now: it schedules the live peers on "
                       "its current view and reconfigures the run (see docs/control.md), as it does by "
                       "itself when a peer dies or joins. Any peer of the run may be asked: one that is "
                       "not the coordinator forwards the request to it. Prints the coordinator's answer: "
                       "its kind, the old -> new shape (stages x pipelines) and the stage moves; --json "
                       "prints all of it.",
                       timeout_s=300.0, timeout_help="how long to wait for the coordinator's answer",
                       json_help="print the coordinator's answer as JSON")
    _add_signed_parser(sub, "export", "gather a run's model from its peers into one Hugging Face folder",
                       "Gather every stage of a run at the newest step they are all held at, from the "
                       "peers that hold them (their weights only, not the optimizer or compression state; "
                       "over the swarm's transport, every chunk checked against its sha256), into one "
                       "Hugging Face GPT-2 folder on this machine: model.safetensors, "
                       "config.json and a tokenizer, which `GPT2LMHeadModel.from_pretrained(DIR)` and "
                       "`python -m dtfm.train sample --model DIR` load. Signed with the operator key: the "
                       "holders give the weights only to the peer the signed export names (this daemon).",
                       first=_add_export_args, timeout_s=3600.0,
                       timeout_help="how long the whole export may take", json_help="print the summary as JSON")
    return parser


def _run_id(text: str) -> str:
    try:
        if len(bytes.fromhex(text)) == 16:
            return text.lower()
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"must be a run id of 32 hex digits, got {text!r}")


def compression_arg(text: str) -> str:
    """`--compress NAME[,FIELD=VALUE...]` checked as `python -m dtfm.train --compress` checks it;
    the canonical text of the config it names (what the signed start carries)."""
    from dtfm.train import parse_compression  # (torch: only when the option is given)
    try:
        return parse_compression(text).to_spec()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _spec_arg(key: str):
    """An argparse type for the run spec key `key`: its type and range (peer/runspec.py)."""
    spec = RUN_SPEC_KEYS[key]
    flag = "--" + key.replace("_", "-")

    def parse(text: str):
        try:
            value = spec.kind(text) if spec.kind in (int, float) and not (spec.auto and text == "auto") else text
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if spec.kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        try:
            return spec.check(flag, value, None)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(flag + " ")) from None
    return parse


def _stages(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return POSITIVE_INT(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {text!r}") from None


# ---- commands ---------------------------------------------------------------------------------

def _client_config(args: argparse.Namespace) -> tuple[DaemonConfig, DataDir]:
    config = load_toml(args.config) if getattr(args, "config", None) else DaemonConfig.default()
    root = args.data_dir or config.peer.data_dir or default_data_dir()
    return config, DataDir(root.absolute())


def cmd_keygen(args: argparse.Namespace) -> int:
    data_dir = DataDir((args.data_dir or default_data_dir()).absolute())
    data_dir.ensure()
    existed = (data_dir.root / IDENTITY_FILE).exists()
    identity = Identity.load_or_create(data_dir.root)
    if args.json:
        print(json.dumps({"peer_id": identity.peer_id.hex(), "short_id": identity.short_id,
                          "created": not existed, "data_dir": str(data_dir.root)}))
    else:
        verb = "kept the existing" if existed else "created a new"
        print(f"{verb} identity in {data_dir.root}", file=sys.stderr)
        print(identity.peer_id.hex())
    return 0


def cmd_swarm_key(args: argparse.Namespace) -> int:
    key = new_swarm_key()
    if args.out is None:
        if args.force:
            raise CliError("--force goes with --out FILE")
        print(key)
        print("(no operator key: `dtfm-peer swarm-key new --out FILE` makes one beside FILE and names it "
              "in FILE)", file=sys.stderr)
        return 0
    if args.out.exists() and not args.force:
        raise CliError(f"{args.out} exists; not overwriting a swarm key (use --force to replace it)")
    op_path = operator_key_path(args.out)
    operator = OperatorKey.create(op_path, replace=args.force)
    try:
        write_private_file(args.out, key + "\n" + operator_line(operator.public_key) + "\n", replace=args.force)
    except CliError:
        op_path.unlink(missing_ok=True)
        raise
    print(f"wrote a new swarm key to {args.out} and its operator key to {op_path} (mode 0600): copy "
          f"{args.out} to every peer, keep {op_path} where you run `dtfm-peer train`", file=sys.stderr)
    return 0


def cmd_operator_key(args: argparse.Namespace) -> int:
    key = OperatorKey.create(args.out, replace=args.force)
    print(f"wrote a new operator key to {args.out} (mode 0600); add the line below to the swarm key file "
          "of every peer and restart them, then sign with `dtfm-peer train ... --operator-key "
          f"{args.out}`", file=sys.stderr)
    print(operator_line(key.public_key))
    return 0


def write_private_file(path: Path, text: str, *, replace: bool) -> None:
    """Write `text` to `path` with mode 0600 whatever the umask: into a new temporary file
    beside it (O_EXCL, 0600), then linked into place (refused if `path` exists) or, with
    `replace`, renamed over it. Readers never see a partial or world-readable file."""
    try:
        atomic_write(path, text, mode=0o600, replace=replace)
    except FileExistsError:
        raise CliError(f"{path} exists; not overwriting a swarm key (use --force to replace "
                       f"it)") from None
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror}") from None


def _daemon_status(args: argparse.Namespace) -> dict:
    """The local daemon's status map (`status`, `members`)."""
    config, data_dir = _client_config(args)
    with ControlClient(data_dir.control_socket, config.socket, data_dir=data_dir.root) as c:
        report = c.request("status")
    if not isinstance(report, dict):
        raise CliError("the daemon sent a status that is not a map")
    return report


def cmd_status(args: argparse.Namespace) -> int:
    report = _daemon_status(args)
    print(to_json(report) if args.json else format_status_text(report))
    return 0


def cmd_members(args: argparse.Namespace) -> int:
    report = _daemon_status(args)
    rows = member_rows(report)
    if args.json:
        gossip, training = report.get("gossip"), report.get("training")
        gossip = gossip if isinstance(gossip, dict) else {}
        training = training if isinstance(training, dict) else {}
        print(json.dumps({"peer_id": report.get("peer_id"), "coordinator": training.get("coordinator"),
                          "run_id": training.get("run_id"), "epoch": training.get("epoch"), "members": rows,
                          "truncated": "members" in (gossip.get("truncated") or [])}, indent=2))
    else:
        print(format_members(rows, report))
    return 0


def cmd_leave(args: argparse.Namespace) -> int:
    config, data_dir = _client_config(args)
    with ControlClient(data_dir.control_socket, config.socket, data_dir=data_dir.root) as c:
        reply = c.request("leave")
    pid = reply.get("pid") if isinstance(reply, dict) else None
    if args.no_wait:
        print(f"daemon (pid {pid}) is leaving", file=sys.stderr)
        return 0
    print(f"daemon (pid {pid}) is leaving (a peer of a run first hands its part off at a step boundary)...",
          file=sys.stderr)
    deadline = time.monotonic() + args.timeout
    lock = DataDirLock(data_dir)
    while time.monotonic() < deadline:
        try:
            with ControlClient(data_dir.control_socket, config.socket, data_dir=data_dir.root):
                pass
        except DaemonNotRunning:
            if not lock.in_use():  # its data dir is free: a daemon may start on it at once
                print(f"daemon (pid {pid}) left", file=sys.stderr)
                return 0
        time.sleep(0.05)
    raise CliError(f"the daemon (pid {pid}) accepted `leave` but still runs after "
                   f"{args.timeout:g} s")


def _operator_key(args: argparse.Namespace, info: dict) -> OperatorKey:
    """The operator key that signs: --operator-key, else the one beside the daemon's swarm key
    file; it must be one of the operators the swarm key file names."""
    path = args.operator_key
    if path is None:
        swarm_key_file = info.get("swarm_key_file")
        if not isinstance(swarm_key_file, str):
            raise CliError("the daemon names no swarm key file: give the operator key with --operator-key FILE")
        path = operator_key_path(Path(swarm_key_file))
    key = OperatorKey.load(path)
    operators = info.get("operators")
    if not isinstance(operators, list) or key.public_key.hex() not in operators:
        raise CliError(f"the operator key {path} ({key.short_id}) is not one of this swarm's operators: the "
                       "swarm key file lists them (`dtfm-peer operator-key new` prints the line to add)")
    return key


def _train_info(c: ControlClient, args: dict | None = None) -> dict:
    info = c.request("train_info", args or {})
    if not isinstance(info, dict):
        raise CliError("the daemon sent an answer to `train_info` that is not a map")
    return info


def _current_run(info: dict, what: str) -> bytes:
    run = info.get("run_id")
    if not isinstance(run, str):
        raise CliError(f"no training run is in progress on this peer: nothing to {what}")
    return bytes.fromhex(run)


class OperatorSession:
    """A connection to the daemon that signs operations with the operator key: `info` is the
    daemon's `train_info` answer (its run, last run, peer id, operators)."""

    def __init__(self, client: ControlClient, info: dict, key: OperatorKey) -> None:
        self.client = client
        self.info = info
        self.key = key

    def send(self, command: str, kind: str, run_id: bytes | None, op_args: dict | None = None,
             **fields: object) -> dict:
        """Sign a `kind` operation on `run_id` (None: a start's fresh run) with `op_args`, send it
        as the daemon's `command` with `fields` beside it, and return the daemon's answer."""
        from dtfm.control import sign_op  # (the operation and allocation types: only when signing)
        op = sign_op(self.key, kind, now_s=time.time(), run_id=run_id, args=op_args)
        reply = self.client.request(command, {"op": op.to_wire(), **fields})
        if not isinstance(reply, dict):
            raise CliError(f"the daemon sent an answer to `{command.replace('_', ' ')}` that is not a map")
        return reply

    def start(self, request: dict) -> dict:
        """`train start` of `request`, signed and sent; again when an election interrupted it
        (`send_start`)."""
        return send_start(lambda: self.send("train_start", "start", None, request), self._term,
                          (ControlClientError,), lambda text: print(text, file=sys.stderr))

    def _term(self) -> int | None:
        """The election term of the daemon; None when its status does not say."""
        try:
            status = self.client.request("status", {})
        except ControlClientError:
            return None
        term = ((status if isinstance(status, dict) else {}).get("training") or {}).get("term")
        return term if type(term) is int else None


@contextlib.contextmanager
def operator_session(args: argparse.Namespace, config: DaemonConfig, data_dir: DataDir,
                     timeout_s: float | None = None, info_args: dict | None = None) -> Iterator[OperatorSession]:
    """Connect to the daemon (each request within `timeout_s`, default the socket's), ask its
    `train_info` (with `info_args`) and pick the operator key that signs (--operator-key,
    checked against it)."""
    control = config.socket if timeout_s is None else dataclasses.replace(config.socket, request_timeout_s=timeout_s)
    with ControlClient(data_dir.control_socket, control, data_dir=data_dir.root) as c:
        info = _train_info(c, info_args)
        yield OperatorSession(c, info, _operator_key(args, info))


def cmd_train(args: argparse.Namespace) -> int:
    if args.train_command == "status":
        return _train_status(args)
    config, data_dir = _client_config(args)
    if args.train_command == "reschedule":
        return _train_reschedule(args, config, data_dir)
    if args.train_command == "resume":
        return _train_resume(args, config, data_dir)
    if args.train_command == "council":
        return _train_council(args, config, data_dir)
    if args.train_command == "stop":
        with operator_session(args, config, data_dir, args.timeout) as s:
            reply = s.send("train_stop", "stop", _current_run(s.info, "stop"))
        print(json.dumps(reply, indent=2, sort_keys=True) if args.json else format_stopped(reply))
        return 0
    values, init = _start_values(args)
    request = start_request(values)
    min_peers = values["min_peers"]
    request.update(min_peers=min_peers, wait_s=float(args.timeout) if min_peers > 1 else 0.0)
    if init is not None:
        request.update(init_from=init[0], init_name=init[1])
    if min_peers > 1:
        print(f"waiting for {min_peers} live, measured peers (at most {args.timeout:g} s; "
              "`dtfm-peer status` shows the count)", file=sys.stderr)
    # the scheduling and the hand-out after the wait get their own --timeout
    wait = {"wait_peers": min_peers, "wait_s": float(args.timeout)} if min_peers > 1 else {}
    with operator_session(args, config, data_dir, args.timeout * (3 if min_peers > 1 else 1), wait) as s:
        request.update(data_hash=s.info.get("data_hash"), data_name=s.info.get("data_name") or "")
        if isinstance(s.info.get("council"), str):  # the first council, for a swarm that has none yet
            request.update(council=s.info["council"], council_size=s.info.get("council_size", 5))
        reply = s.start(request)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
        return 0
    model = values["preset"] if init is None else f"{init[1]} ({reply.get('model', 'hf')})"
    print(format_started(model, reply))
    knobs = {k: v for k, v in request.items() if k in TRAIN_KNOBS}
    if knobs:
        print("  training config: " + ", ".join(f"{k} {v}" for k, v in knobs.items()))
    for d, pipe in enumerate(reply["pipelines"]):
        print(f"  pipeline {d}: " + " -> ".join(p[:8] for p in pipe))
    if reply["spares"]:
        print("  spares: " + ", ".join(p[:8] for p in reply["spares"]))
    print(f"follow it: dtfm-peer train status --follow (on any daemon of the run); step log: {reply['log']}")
    return 0


def _start_values(args: argparse.Namespace) -> tuple[dict, tuple[str, str] | None]:
    """The resolved run spec of `train start` (flags over --spec over defaults) and, for
    --init-from, the model folder's (digest, name); a bad spec or folder exits 2."""
    try:
        spec = load_run_spec(args.spec) if args.spec is not None else {}
        values = resolve({key: getattr(args, key, None) for key in RUN_SPEC_KEYS}, spec)
        if values["stages"] == "auto" and values["dp"] is not None:
            raise ConfigError("--dp (dp) needs --stages S (stages)")
        if values["compress"] is not None:
            values["compress"] = compression_arg(values["compress"])
    except (ConfigError, argparse.ArgumentTypeError) as e:
        args.subparser.error(str(e))  # exits 2, with the usage
    init = None
    if values["init_from"] is not None:
        try:
            init = init_folder(Path(values["init_from"]))
        except ConfigError as e:
            args.subparser.error(str(e))
    from dtfm.control import TrainError, TrainRequest
    try:  # the knobs' joint checks (TrainConfig's), before anything is signed
        TrainRequest.from_args({**start_request(values), "data_hash": "0" * 64,
                                **({"init_from": init[0]} if init else {})})
    except TrainError as e:
        args.subparser.error(str(e))
    return values, init


def _train_status(args: argparse.Namespace) -> int:
    from .follow import ASK_COORDINATOR_S, follow
    config, data_dir = _client_config(args)
    # the daemon may look for the coordinator, then ask it, each within its request timeout
    control = dataclasses.replace(config.socket, request_timeout_s=config.socket.request_timeout_s + ASK_COORDINATOR_S)
    with ControlClient(data_dir.control_socket, control, data_dir=data_dir.root) as c:
        def ask(request: dict) -> dict:
            reply = c.request("train_status", request)
            if not isinstance(reply, dict):
                raise CliError("the daemon sent an answer to `train status` that is not a map")
            return reply
        return follow(ask, sys.stdout, run=args.run, keep_following=args.follow, as_json=args.json)


def _train_reschedule(args: argparse.Namespace, config: DaemonConfig, data_dir: DataDir) -> int:
    with operator_session(args, config, data_dir, args.timeout) as s:
        reply = s.send("train_reschedule", "reschedule", _current_run(s.info, "reschedule"))
    print(json.dumps(reply, indent=2, sort_keys=True) if args.json else format_reschedule(reply))
    return 0


def resume_run_id(asked: str | None, info: dict) -> bytes:
    """The run a resume names: RUN (a full id, or a prefix of the swarm's last run), else the
    swarm's last run as the daemon knows it."""
    last = info.get("last_run_id")
    last = last if isinstance(last, str) else None
    if asked is None:
        if last is None:
            raise CliError("this peer knows no run to resume: name it (`dtfm-peer train resume RUN`) or ask a "
                           "peer that took part in it")
        return bytes.fromhex(last)
    asked = asked.lower()
    if last is not None and last.startswith(asked):
        return bytes.fromhex(last)
    if len(asked) == 32 and all(c in "0123456789abcdef" for c in asked):
        return bytes.fromhex(asked)  # (the coordinator says whether it knows it)
    raise CliError(f"unknown run {asked!r}: this peer's last run is {last[:8] if last else 'none'}; give a "
                   "prefix of it or a full 32-digit run id")


def _train_council(args: argparse.Namespace, config: DaemonConfig, data_dir: DataDir) -> int:
    with operator_session(args, config, data_dir, args.timeout) as s:
        voters = args.voters
        if voters is None:
            if s.info.get("council_rooted"):
                print("the daemon holds a council; naming its live peers as the new one (--voters names others)",
                      file=sys.stderr)
            voters = _proposed_council(s.client, s.info)
        size = args.council_size or s.info.get("council_size", 5)
        if len(voters.split(",")) > size:
            raise CliError(f"a council of {len(voters.split(','))} voters is larger than its size {size} "
                           "(--council-size)")
        reply = s.send("train_council", "council", None, {"council": voters, "council_size": size})
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    else:
        print(f"council rooted: {len(reply['voters'])} voters ({', '.join(v[:8] for v in reply['voters'])}); "
              f"{reply['told']} live peers told")
    return 0


def _proposed_council(c: ControlClient, info: dict) -> str:
    """The council the daemon proposes of its live peers: `train_info` of a daemon that holds
    a council names that one, so ask `council_proposal`."""
    if not info.get("council_rooted") and isinstance(info.get("council"), str):
        return info["council"]
    reply = c.request("council_proposal", {})
    if not isinstance(reply, dict) or not isinstance(reply.get("council"), str):
        raise CliError("the daemon sent an answer to `council_proposal` without a council")
    return reply["council"]


def _council_ids(text: str) -> str:
    ids = sorted({x.strip().lower() for x in text.split(",") if x.strip()})
    if not ids or any(len(x) != 64 or x.strip("0123456789abcdef") for x in ids):
        raise argparse.ArgumentTypeError("a comma-separated list of peer ids (64 hex digits each)")
    return ",".join(ids)


def _train_resume(args: argparse.Namespace, config: DaemonConfig, data_dir: DataDir) -> int:
    with operator_session(args, config, data_dir, args.timeout) as s:
        run = resume_run_id(args.run, s.info)
        reply = s.send("train_resume", "resume", run)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    else:
        print(f"run {run.hex()[:8]} {format_resume(reply.get('resume_step', '?')).replace('resumed', 'resumes')}: "
              f"{format_reschedule(reply, resumed=False)}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import threading

    config, data_dir = _client_config(args)
    out = args.out.absolute()
    if out.exists() and not args.force:
        raise CliError(f"{out} exists: choose another folder, or pass --force to replace it")
    done = threading.Event()

    def show_progress() -> None:
        """Poll the daemon's export progress on a second connection; one line per change."""
        said = None
        try:
            with ControlClient(data_dir.control_socket, config.socket, data_dir=data_dir.root) as c:
                while not done.wait(1.0):
                    p = c.request("export_progress", {})
                    if not isinstance(p, dict) or not p or p.get("phase") in ("done", "failed"):
                        continue
                    line = (f"export of run {p.get('run')}: {p.get('phase')}" + (
                        f", step {p['step']}, {p.get('stages_done')} of {p.get('stages')} stages, "
                        f"{int(p.get('bytes_fetched') or 0) / 1e6:.1f} MB fetched" if p.get("step") is not None else ""))
                    if line != said:
                        print(line, file=sys.stderr)
                        said = line
        except Exception:  # progress is a courtesy: the export's own answer says how it went
            return

    with operator_session(args, config, data_dir, args.timeout) as s:
        run = resume_run_id(args.run, s.info)
        peer = s.info.get("peer_id")
        if not isinstance(peer, str):
            raise CliError("the daemon did not say its peer id: run the same dtfm version as the daemon")
        watcher = threading.Thread(target=show_progress, daemon=True)
        watcher.start()
        try:
            reply = s.send("export", "export", run, {"peer": peer}, out=str(out), overwrite=bool(args.force))
        finally:
            done.set()
            watcher.join(timeout=2.0)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    else:
        print(format_exported(run.hex(), reply))
        print(f"load it with GPT2LMHeadModel.from_pretrained({str(out)!r}), or sample: "
              f"python -m dtfm.train sample --model {out} --prompt TEXT")
    return 0


PREDICTION_CAVEAT = "from each peer's speed measured on its own: slower where peers share cores or a machine is busy"


def format_started(model: str, reply: dict) -> str:
    """`training tiny for 100 steps as 1 stage x 3 pipelines; predicted 0.061 s per step (...)`:
    the prediction with what it rests on (each peer's compute and links measured at its start,
    which a loaded machine does not keep up: docs/operator.md, "Predicted and measured")."""
    return (f"training {model} for {reply['steps']} steps as {plural(reply['stages'], 'stage')} x "
            f"{plural(reply['dp'], 'pipeline')}; predicted {reply['predicted_iteration_s']:.3f} s per step "
            f"({PREDICTION_CAVEAT})"
            + (f"; compression {reply['compression']}" if reply.get("compression", "exact") != "exact" else "")
            + (f"\nshape: {reply['shape_note']}" if reply.get("shape_note") else ""))


def format_stopped(reply: dict) -> str:
    """`the run stops after step 70 (3 peers told)`: `at_step` is the daemons' index of the first
    step not taken, that is the steps done."""
    at = reply.get("at_step")
    return (f"the run stops {f'after step {at}' if at else 'before its first step'} "
            f"({plural(reply.get('told', '?'), 'peer')} told)")


def format_exported(run_hex: str, reply: dict) -> str:
    """`exported run 8df90683 at step 600 (tiny, 1 stage, 3.5 MB fetched) to DIR`."""
    return (f"exported run {run_hex[:8]} at step {reply.get('step')} ({reply.get('model')}, "
            f"{plural(len(reply.get('stages') or []), 'stage')}, {int(reply.get('bytes_fetched') or 0) / 1e6:.1f} MB "
            f"fetched) to {reply.get('out')}")


def format_reschedule(reply: dict, *, resumed: bool = True) -> str:
    """One line for the coordinator's answer: kind, old -> new shape, moves (and more when
    given; without `resumed`, not the step it resumes after, which a resume's line says first).
    Every field is optional."""
    kind = reply.get("kind") or reply.get("event") or reply.get("result") or "answered"
    reconf = reconfiguration_parts(reply)
    parts = [str(kind), *(reconf[k] for k in ("shape", "moves", "moved") if k in reconf)]
    old_s, new_s = reply.get("predicted_old_s"), reply.get("predicted_new_s")
    if isinstance(new_s, (int, float)):
        parts.append("predicted " + (f"{old_s:.3f} s -> " if isinstance(old_s, (int, float)) else "")
                     + f"{new_s:.3f} s per step")
    if reply.get("epoch") is not None:
        parts.append(f"epoch {reply['epoch']}")
    if "resumed" in reconf and resumed:
        parts.append(reconf["resumed"])
    if reply.get("reason") and (resumed or reply["reason"] != "train resume"):
        parts.append(str(reply["reason"]))
    return ", ".join(parts)


def cmd_join(args: argparse.Namespace) -> int:
    config = load_toml(args.config) if args.config else DaemonConfig.default()
    try:
        config = apply_flags(config, args)
        check_device(config.plane.device)
    except ConfigError as e:
        args.subparser.error(str(e))  # exits 2, with the usage
    try:
        logs.configure(config.log.level, json_lines=config.log.json, file=config.log.file,
                       max_bytes=int(config.log.max_mb * (1 << 20)), backups=config.log.backups)
    except OSError as e:
        args.subparser.error(f"--log-file {config.log.file}: cannot open it: {e.strerror}")
    from .runner import run_daemon  # the daemon's services load torch: only `join` pays for it

    # A fatal signal (a native crash in torch or libsodium) prints every thread's Python stack
    # to stderr: what the operator (and dtfm-swarm's daemon.out) keeps of a daemon that died so.
    with contextlib.suppress(OSError, ValueError):  # (a stderr with no file behind it: in-process callers)
        faulthandler.enable()
    return run_daemon(config)


def check_device(device: str) -> None:
    """ConfigError unless torch can build a stage on `device` here (cuda: a GPU torch sees)."""
    if device == "cpu":
        return
    import torch  # (the daemon loads it anyway; only a GPU device pays for it here)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if count == 0:
        raise ConfigError(f"plane.device (--device) {device}: torch sees no CUDA device on this machine "
                          f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): use --device cpu, "
                          "or install a CUDA build of torch")
    if index >= count:
        raise ConfigError(f"plane.device (--device) {device}: torch sees {count} CUDA device(s), "
                          f"cuda:0 to cuda:{count - 1}")


def user_error_text(exc: BaseException) -> str | None:
    """The message for an error the user can act on, or None for a real bug."""
    return _user_error_text(exc, USER_ERRORS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"keygen": cmd_keygen, "swarm-key": cmd_swarm_key, "operator-key": cmd_operator_key, "join": cmd_join,
                "status": cmd_status, "members": cmd_members, "leave": cmd_leave, "train": cmd_train, "export": cmd_export}
    return run_command(PROG, lambda: commands[args.command](args), user_errors=USER_ERRORS)
