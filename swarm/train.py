"""Training on a scripted swarm: start a run, follow it, keep its logs in the run dir.

The coordinator daemon writes, in its data dir, `train.jsonl` (one line per step every peer
completed) and `events.jsonl` (one line per event: elected, reconfigured, rolled back, stopped).
The coordinator can change during a run; the new one writes into its own data dir, and may
back-fill the last steps it learns of from the peers, so the logs of two coordinators overlap.
`sync_logs` merges the files of EVERY peer's data dir (a dead peer's dir is still readable)
into the run dir, atomically:

    RUN_DIR/train.jsonl    one line per step, steps sorted; of several lines for one step the
                           one with the highest (term, epoch) wins
    RUN_DIR/events.jsonl   every event once, sorted by time
    RUN_DIR/run.json       {"run_id", "started_at", "issuer", "request", "allocation"} of the run
                           `dtfm-swarm train` started: lines of earlier runs (still in some data
                           dir) are left out of the merge; `dtfm-swarm report` names the preset,
                           seed and allocation from it

`wait_step` follows the merged log, so it keeps working whichever peer coordinates.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtfm.files import atomic_write
from dtfm.net import KeyFileError, OperatorKey, operator_key_path
from dtfm.peer import send_start, steps_done

from .proc import peer_request, peer_status
from .report import council_lost, council_lost_text
from .state import KEY_FILE, PeerEntry, SwarmError, SwarmState

if TYPE_CHECKING:
    from dtfm.control import SignedOp

__all__ = ["EVENTS_NAME", "LOG_NAME", "RUN_NAME", "START_TIMEOUT_S", "current_run", "merge_events", "merge_train",
           "operator_op", "read_log", "run_end", "start_training", "stop_training", "sync_logs", "wait_step", "write_jsonl"]

LOG_NAME = "train.jsonl"
EVENTS_NAME = "events.jsonl"
RUN_NAME = "run.json"
START_TIMEOUT_S = 180.0  # a train start: the scheduler, the hand-out, every placed peer building its stage
# A run that looks ended must look so this long before `wait` gives up: a coordinator that
# just died leaves the survivors "stopped" until the next one reconfigures them.
END_SETTLE_S = 5.0
# (A spare's state says nothing: the coordinator of a run it does not train in shows "spare".)
LIVE_STATES = frozenset({"training", "accepted", "building", "handing out", "reconfiguring"})
ELECTION_EVENTS = frozenset({"coordinator", "stepped-down"})
ELECTING_ROLES = frozenset({"candidate", "pre-candidate"})


def operator_op(run_dir: Path, peer: PeerEntry, kind: str, args: dict | None = None) -> SignedOp:
    """An operation of the swarm's operator (its key is beside the run dir's swarm key), signed
    now: a start names `peer`'s data set by its hash; a stop or reschedule, `peer`'s run."""
    from dtfm.control import sign_op  # the allocation's model types load torch: only when signing
    try:
        key = OperatorKey.load(operator_key_path(run_dir / KEY_FILE))
    except KeyFileError as e:
        raise SwarmError(f"{e} (a swarm started by `dtfm-swarm up` has one)") from None
    info = peer_request(peer, "train_info", {}, timeout_s=60.0)
    if kind == "start":
        args = {**(args or {}), "data_hash": info.get("data_hash"), "data_name": info.get("data_name") or ""}
        if isinstance(info.get("council"), str):  # the first council, for a swarm that has none yet
            args.update(council=info["council"], council_size=info.get("council_size", 5))
        return sign_op(key, "start", now_s=time.time(), args=args)
    run = info.get("run_id")
    if not isinstance(run, str):
        raise SwarmError(f"{peer.name}: no training run is in progress")
    return sign_op(key, kind, now_s=time.time(), run_id=bytes.fromhex(run))


def start_training(state: SwarmState, peer: PeerEntry, args: dict, run_dir: Path,
                   timeout_s: float = START_TIMEOUT_S) -> dict:
    """`train_start` on `peer`, signed by the swarm's operator: the swarm schedules, hands the
    allocation out and starts. Records the run in `run_dir` so the merged logs leave out
    earlier runs' lines."""
    started_at = time.time()
    # (stages "auto" is no argument; micro_batches "auto" is: the operator leaves the count to the scheduler)
    args = {k: v for k, v in args.items() if v is not None and not (k == "stages" and v == "auto")}

    def send() -> dict:
        op = operator_op(run_dir, peer, "start", args)
        return peer_request(peer, "train_start", {"op": op.to_wire()}, timeout_s=timeout_s)
    reply = send_start(send, lambda: _term(peer), (SwarmError,), lambda text: print(text, file=sys.stderr))
    record = {"run_id": reply.get("run_id"), "started_at": started_at, "issuer": peer.name,
              "request": args, "allocation": reply}
    atomic_write(run_dir / RUN_NAME, json.dumps(record, sort_keys=True) + "\n", mode=0o600)
    return reply


def _term(peer: PeerEntry) -> int | None:
    """The election term `peer` is in; None when it does not answer."""
    term = ((peer_status(peer) or {}).get("training") or {}).get("term")
    return term if isinstance(term, int) else None


def stop_training(run_dir: Path, peer: PeerEntry, timeout_s: float = 30.0) -> dict:
    """`train_stop` on `peer`, signed by the swarm's operator: the run ends on every peer."""
    op = operator_op(run_dir, peer, "stop")
    return peer_request(peer, "train_stop", {"op": op.to_wire()}, timeout_s=timeout_s)


# ---- reading and writing JSON lines ---------------------------------------------------------

def read_log(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file, in file order; [] when there is none. A line that
    is not a JSON object (one a daemon is appending right now) is skipped."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return []
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    """Write `rows` as JSON lines: into a temporary file beside `path`, then renamed over it,
    so a reader sees the old file or the new one, never a part."""
    atomic_write(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), mode=0o600)
    return path


# ---- merging the coordinators' logs (pure) ----------------------------------------------------

def _num(value: Any, default: float) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _rank(row: dict) -> tuple:
    """Which line of one step wins: the newer epoch (epochs grow across terms; a step run again
    after a rollback has the newer one); within an epoch a line with the loss over one without
    (a lost report), the line its own coordinator logged from every report over one back-filled
    or logged from some reports; then the higher term, then the later line."""
    return (_num(row.get("epoch"), -1), row.get("loss") is not None, not row.get("backfilled"),
            not row.get("partial"), _num(row.get("term"), -1), _num(row.get("time"), 0.0))


def merge_train(sources: Iterable[list[dict]]) -> list[dict]:
    """One line per step, sorted by step, from the train logs of several coordinators."""
    best: dict[int, dict] = {}
    for rows in sources:
        for row in rows:
            step = row.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            if step not in best or _rank(row) > _rank(best[step]):
                best[step] = row
    return [best[k] for k in sorted(best)]


def merge_events(sources: Iterable[list[dict]]) -> list[dict]:
    """Every distinct event once, sorted by time (then by content, so the order is stable)."""
    seen: dict[str, dict] = {}
    for rows in sources:
        for row in rows:
            seen.setdefault(json.dumps(row, sort_keys=True), row)
    return [seen[k] for k in sorted(seen, key=lambda k: (_num(seen[k].get("time"), 0.0), k))]


def _of_run(row: dict, run: dict) -> bool:
    """False for a line that belongs to an earlier run than `run` (RUN_DIR/run.json)."""
    run_id, line_run = run.get("run_id"), row.get("run", row.get("run_id"))
    if run_id and isinstance(line_run, str) and line_run != run_id:
        return False
    started_at, at = run.get("started_at"), row.get("time")
    return not (isinstance(started_at, (int, float)) and isinstance(at, (int, float)) and at < started_at)


# ---- the run dir ------------------------------------------------------------------------------

def current_run(run_dir: Path) -> dict:
    try:
        run = json.loads((run_dir / RUN_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return run if isinstance(run, dict) else {}


def sync_logs(run_dir: Path, state: SwarmState) -> tuple[list[dict], list[dict]]:
    """Merge every peer's train.jsonl and events.jsonl into the run dir (each file written only
    when some peer has one); returns (train lines, events)."""
    run = current_run(run_dir)
    train_src: list[list[dict]] = []
    event_src: list[list[dict]] = []
    for peer in state.peers:
        for name, into in ((LOG_NAME, train_src), (EVENTS_NAME, event_src)):
            path = Path(peer.data_dir) / name
            if path.exists():
                # elections are the swarm's history, not one run's: they are always kept
                into.append([r for r in read_log(path)
                             if _of_run(r, run) or (into is event_src and r.get("event") in ELECTION_EVENTS)])
    rows, events = merge_train(train_src), merge_events(event_src)
    if train_src:
        write_jsonl(run_dir / LOG_NAME, rows)
    if event_src:
        write_jsonl(run_dir / EVENTS_NAME, events)
    return rows, events


# ---- following a run ----------------------------------------------------------------------

def _latest_issued(statuses: list[dict]) -> dict | None:
    """The run record of the coordinator with the highest term; else the latest issued one."""
    best, best_key = None, None
    for st in statuses:
        training = st.get("training") or {}
        issued = training.get("issued")
        if not isinstance(issued, dict):
            continue
        key = (training.get("role") == "coordinator", _num(training.get("term"), -1),
               _num(issued.get("started_at"), 0.0))
        if best_key is None or key > best_key:
            best, best_key = issued, key
    return best


def run_end(statuses: list[dict], events: list[dict]) -> str | None:
    """Why the run looks over, from the live peers' statuses and the merged events; None while
    some peer trains, an election runs, or nothing says it ended."""
    trainings = [st.get("training") or {} for st in statuses]
    if any(t.get("state") in LIVE_STATES or t.get("role") in ELECTING_ROLES for t in trainings):
        return None
    run_events = [e for e in events if e.get("event") not in ELECTION_EVENTS]
    last = run_events[-1] if run_events else None
    if last is not None and last.get("event") == "stopped":
        why = ": ".join(str(w) for w in dict.fromkeys([last.get("trigger"), last.get("reason")]) if w)
        return (f"training stopped (term {last.get('term')}, epoch {last.get('epoch')}): "
                f"{why or 'no reason given'}")
    issued = _latest_issued(statuses)
    if issued is None:
        return None
    state = issued.get("state")
    if state in ("stopped", "refused"):
        return (f"training {state} after {steps_done(issued.get('completed'))} steps: "
                f"{issued.get('reason') or 'no reason given'}")
    if state == "finished":
        return f"training finished: all {steps_done(issued.get('completed'))} steps done"
    return None


def wait_step(state: SwarmState, run_dir: Path, step: int, timeout_s: float, poll_s: float = 0.5,
              settle_s: float = END_SETTLE_S) -> dict:
    """Block until the merged log reaches step `step` (the log's 0-based index); returns that
    log's last line. SwarmError with the reason if the run ended first (and stayed ended for
    `settle_s`: a coordinator may be taking over) or the time ran out; its text counts steps
    from 1, as every text for people does."""
    deadline = time.monotonic() + timeout_s
    ended_since: float | None = None
    rows: list[dict] = []
    while True:
        rows, events = sync_logs(run_dir, state)
        if rows and rows[-1]["step"] >= step:
            return rows[-1]
        statuses = [st for st in (peer_status(p) for p in state.peers) if st is not None]
        why = run_end(statuses, events)
        if why is None:  # nothing goes on without a council that can elect: said, not waited out
            lost = council_lost([st.get("training") or {} for st in statuses],
                                {p.peer_id: p.name for p in state.peers if p.peer_id})
            if lost is not None:
                why = council_lost_text(lost)
        now = time.monotonic()
        if why is None:
            ended_since = None
        else:
            ended_since = now if ended_since is None else ended_since
            if now - ended_since >= settle_s:
                raise SwarmError(f"{why}; step {step + 1} not reached")
        if now > deadline:
            where = f"last completed step {rows[-1]['step'] + 1}" if rows else "no step logged yet"
            raise SwarmError(f"step {step + 1} not reached within {timeout_s:g} s ({where}"
                             + (f"; {why}" if why else "") + ")")
        time.sleep(poll_s)
