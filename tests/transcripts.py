"""Machine transcripts as data, in the form of raft's testdata: tests/data/coordinator/*.txt,
tests/data/deadline/*.txt (n0's coordinator, tests/coordinator_fixtures.py's `Node`) and
tests/data/epoch/*.txt (one peer's epoch machine, tests/epoch_fixtures.py's `Peer`).

A file is a sequence of blocks, each a command, a line `----` and the command's output, a
blank line between blocks; `#` lines above a command are comments. The output of an input is
its transcript (tests/machine_trace.py's `describe` and `show`): the input with its time, the
machine's actions under it, the coordinator's phase when it changes. `check`
plays a file and compares every block; with DTFM_RECORD_TRACES=1 it writes each block's output
back in place instead (as raft's `-rewrite`), for a reader to check in the diff.

The first command makes the machine under test (a later one starts afresh with another):

    node [live=n1,n2,n3] [voters=...] [wall] [watched] [<CoordinatorTimings field>=<value> ...]
    peer n1 [coordinator=n0|none] [term=1]

(`wall`: operators sign on a wall clock 1.7e9 s ahead of the machine's; `watched`: the step
deadline's timings, `WATCHED`.)

A time is `at=T` (`at=+T`: T after the last input; by default the last input's time). Peers
are n0 .. n5 (machine_trace.py's names), lists of them joined by commas or spaces. Each input
command feeds one event to the machine's `handle` (or, for `answer` and `compute`, the answer
to a request the machine made), and prints what the machine did:

    node:  train-start [KEY] [run=s] [signed=T] [steps=N] [spares=...] [at=T]
           train-stop|train-reschedule|train-resume KEY [signed=T] [run=o] [by=intruder]
               [as=stop|reschedule|resume] [unsigned] [at=T]
           answer WHAT [at=T] PEERS=ANSWER ... [*=ANSWER]
           compute [WHAT] [at=T]            tick [T]            trigger REASON [at=T]
           report PEERS step=S|A..B [epoch=E] [at=T]
           step-failed PEER REASON [epoch=E] [run=o] [at=T]
           elected TERM [at=T]              leave PEER [key=K] [at=T]
    peer:  offer|accept [at=T] [live=...] [known=...] <allocation fields>
           built [at=T]                     build-failed CODE REASON [at=T]
           start from=PEER [epoch=E] [run=o] [at=T]
           stop from=PEER before=S [epoch=E] [run=o] [final] [abort] [signed] [at=T]
           step S [epoch=E] [at=T]          runner-ended EPOCH COMPLETED REASON [failed] [at=T]
           epoch-done EPOCH [at=T]          gone PEER WHY [at=T]
           tick [T]                         again [at=T]
           restore [reports=E:S,...] <allocation fields>   (the shell's restore after a restart)
           restored-heard STATE STEPS [run=o]               (the coordinator's account of that run)

An ANSWER is written as the transcript shows it: `accepted`, `not accepted code=busy
reason='...'`, `started`, `stopped`, `not stopped`, a run state `0-2@2 running` (`-@None`: no
stage; fields prev=, epoch=, run=, checkpoints=0-2@2, reports=1:0,1:1), an offer `D01`
(coordinator_fixtures' digests), `reached n1 n2 not n3`, `kept 0-2@2`; more fields as key=value.
A peer asked and not given does not answer in time (n0 answers ALLOCATION, START and STOP
through its own epoch machine). Allocation fields are machine_trace.py's `alloc()` arguments:
term=, epoch=, issuer=, run=, start=, end=, pipelines='n0 n1 | n2 n3', spares=, absent=, voters=,
last-op-ms=.

Set-ups print `ok`: `training [steps=2] [run-steps=100]` (coordinator_fixtures' `Node.training`),
`accept`, `local-epoch`; so do the changes to the world: `election [term=] [coordinator=]
[applied=T/E]`, `live +n4 -n3`, `unmeasured n4`, `planner [kind=] [error=] [cut=ignored]`.
What the machines say of themselves: `status`, `epoch`, `election`, `planner`, `asks`,
`deadline`, `refusals`, `logs` (warnings logged since the last `logs`), `run-state
[LAYERS@STEP ...]`, `held LAYERS@STEP ...`, `stop-boundary none|S ...`, `restored-ask T`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coordinator_fixtures import D01, D23, PLACEMENT, TIMINGS, WALL, Node, state
from epoch_fixtures import STOP, Peer
from machine_trace import DATA_HASH, DATA_NAME, INTRUDER, OPERATOR, RUN, N, alloc, context, named, peers, report, start_op

from dtfm.control import RunEnd, sign_op
from dtfm.control.coordinator.deadline import DeadlineRules
from dtfm.control.reach import ReachAnswer
from dtfm.control.coordinator.machine import (
    Elected,
    PeerLeaving,
    Reschedule,
    ResumeRun,
    StartRun,
    StepFailed,
    StepReported,
    StopRun,
    Trigger,
)
from dtfm.control.epoch.machine import (
    AllocationOffered,
    BuildFailed,
    BuildStage,
    EpochDone,
    MemberGone,
    RunnerEnded,
    StageBuilt,
    StartAsked,
    StepDone,
    StopAsked,
    EpochTick as Tick,
    WaitForCoordinator,
)

DATA = Path(__file__).resolve().parent / "data"
RECORD = os.environ.get("DTFM_RECORD_TRACES") == "1"
RULES = DeadlineRules(floor_s=3.0, mads=6.0, first_s=20.0)
# the step deadline watched (tests/control/coordinator/test_coordinator_deadline.py), no looks for joined peers in between
WATCHED = dataclasses.replace(TIMINGS, deadline=RULES, deadline_probe_timeout_s=4.0, link_retest_s=2.0,
                              check_interval_s=1000.0)
NAMED = {f"n{i}": p for i, p in enumerate(N)}
RUNS = {"r": RUN, "o": b"o" * 16, "s": b"s" * 16, "a": b"a" * 16, "none": b""}
DIGESTS = {"D01": D01, "D23": D23}


# ---- the file ------------------------------------------------------------------------------------


@dataclass
class Block:
    comments: list[str]
    command: str
    want: list[str]
    line: int  # where the command is in the file

    def text(self, output: list[str]) -> str:
        return "\n".join([*self.comments, self.command, "----", *output])


def parse(text: str) -> list[Block]:
    """The blocks of a transcript file."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        comments = []
        while i < len(lines) and lines[i].startswith("#"):
            comments.append(lines[i])
            i += 1
        if i + 1 >= len(lines) or lines[i + 1] != "----":
            raise ValueError(f"line {i + 1}: a command and then `----` expected")
        command, at = lines[i], i + 1
        i += 2
        want = []
        while i < len(lines) and lines[i].strip():
            want.append(lines[i])
            i += 1
        blocks.append(Block(comments, command, want, at))
    return blocks


def files(folder: str) -> list[Path]:
    return sorted((DATA / folder).glob("*.txt"))


def check(path: Path) -> Play:
    """Play `path`; fail at the first block whose output differs (or rewrite them all). What
    was played, for a test to ask more of the machine."""
    blocks = parse(path.read_text())
    play = Play()
    got: list[list[str]] = []
    with play.logs_caught():
        for b in blocks:
            try:
                out = play.run(b.command) or ["ok"]
            except Exception as e:
                raise AssertionError(f"{path.name}:{b.line}: {b.command}: {type(e).__name__}: {e}") from e
            assert all(x.strip() for x in out), f"{path.name}:{b.line}: a blank line in the output of {b.command}"
            if not RECORD and out != b.want:
                diff = "\n".join(difflib.unified_diff(b.want, out, "expected", "got", lineterm=""))
                raise AssertionError(f"{path.name}:{b.line}: {b.command}: the transcript differs "
                                     f"(re-record with DTFM_RECORD_TRACES=1 if that is meant):\n{diff}")
            got.append(out)
    if RECORD:
        path.write_text("\n\n".join(b.text(out) for b, out in zip(blocks, got)) + "\n")
    return play


# ---- the words of a command ----------------------------------------------------------------------


@dataclass
class Args:
    pos: list[str]
    kv: dict[str, str]

    @classmethod
    def of(cls, words: list[str]) -> Args:
        pos, kv = [], {}
        for w in words:
            k, eq, v = w.partition("=")
            if eq and k and not k[0].isdigit():
                kv[k] = v
            else:
                pos.append(w)
        return cls(pos, kv)

    def flag(self, name: str) -> bool:
        if name in self.pos:
            self.pos.remove(name)
            return True
        return False

    def take(self, name: str, default=None, conv: Callable = str):
        return conv(self.kv.pop(name)) if name in self.kv else default

    def done(self) -> None:
        if self.pos or self.kv:
            raise ValueError(f"not understood: {' '.join(self.pos + [f'{k}={v}' for k, v in self.kv.items()])}")


def peer(name: str) -> bytes:
    return NAMED[name]


def peer_list(text: str) -> tuple[bytes, ...]:
    return tuple(peer(x) for x in text.replace(",", " ").split())


def pipelines(text: str) -> tuple[tuple[bytes, ...], ...]:
    return tuple(peer_list(p) for p in text.split("|"))


def layers(text: str) -> tuple[int, int]:
    a, b = text.split("-")
    return int(a), int(b)


def value(text: str):
    """A field's value: an int, a float, a bool, None or the text."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def held(text: str) -> tuple[int, int, int]:
    """`a-b@s`: layers a-b at step s."""
    where, at = text.split("@")
    return (*layers(where), int(at))


def reports(text: str) -> list:
    """`e:s,...`: the reports of steps s of epochs e."""
    return [report(int(e), int(s)) for e, s in (x.split(":") for x in text.split(","))]


ALLOC_FIELDS: dict[str, tuple[str, Callable]] = {
    "term": ("term", int), "epoch": ("epoch", int), "issuer": ("issuer", peer), "run": ("run_id", RUNS.__getitem__),
    "start": ("start_step", int), "end": ("end_step", int), "pipelines": ("pipelines", pipelines),
    "spares": ("spares", peer_list), "absent": ("absent", peer_list), "voters": ("voters", peer_list),
    "last-op-ms": ("last_op_ms", int)}


def allocation(args: Args):
    fields = {}
    for k, (name, conv) in ALLOC_FIELDS.items():
        if k in args.kv:
            fields[name] = conv(args.kv.pop(k))
    if "pipelines" in fields and len(fields["pipelines"][0]) == 1:
        fields["layer_ranges"] = ((0, 4),)
    return alloc(**fields)


def answer(text: str) -> dict:
    """One peer's answer, written as the transcript shows it (see the module's docstring)."""
    head, *rest = shlex.split(text)
    fields = {}
    for w in [w for w in rest if "=" in w]:
        k, _, v = w.partition("=")
        fields[k] = v
        rest.remove(w)
    if head == "not":
        [what] = rest
        return {what: False, **{k: value(v) for k, v in fields.items()}}
    if head in ("accepted", "started", "stopped"):
        assert not rest, rest
        return {head: True, **{k: value(v) for k, v in fields.items()}}
    if head in DIGESTS:
        return {"digest": DIGESTS[head], **{k: value(v) for k, v in fields.items()}}
    if head == "reached":
        cut = rest.index("not") if "not" in rest else len(rest)
        return ReachAnswer(tuple(peer(x) for x in rest[:cut]), tuple(peer(x) for x in rest[cut + 1:])).to_wire()
    if head == "kept":
        return {"kept": [list(held(x)) for x in rest]}
    if "@" in head:  # a run state
        where, at = head.split("@")
        running = rest == ["running"]
        assert rest in ([], ["running"]), rest
        return state(None if where == "-" else layers(where), None if at == "None" else int(at), running=running,
                     prev=value(fields.pop("prev")) if "prev" in fields else None,
                     epoch=int(fields.pop("epoch", 1)), run=RUNS[fields.pop("run", "r")],
                     checkpoints=[held(x) for x in fields.pop("checkpoints", "").split(",") if x],
                     reports=reports(fields.pop("reports")) if "reports" in fields else ())
    raise ValueError(f"no answer {text!r}")


# ---- playing a file ------------------------------------------------------------------------------


class Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {named(record.getMessage())}")


class Play:
    """The machine a file drives, and one handler per command."""

    def __init__(self) -> None:
        self.node: Node | None = None
        self.peer: Peer | None = None
        self.now = 0.0
        self.caught = Caught()
        self.build: BuildStage | None = None
        self.wait: WaitForCoordinator | None = None
        self.ignore_cut = False

    def logs_caught(self):
        play = self

        class Scope:
            def __enter__(self):
                logging.getLogger("dtfm").addHandler(play.caught)

            def __exit__(self, *exc):
                logging.getLogger("dtfm").removeHandler(play.caught)

        return Scope()

    def run(self, command: str) -> list[str]:
        name, *words = shlex.split(command)
        args = Args.of(words)
        subject = "node" if self.node is not None else "peer" if self.peer is not None else None
        handler = getattr(self, f"{subject}_{name.replace('-', '_')}", None) or getattr(
            self, f"do_{name.replace('-', '_')}", None)
        if handler is None:
            raise ValueError(f"no command {name!r} here")
        out = handler(args)
        args.done()
        return out

    def at(self, args: Args) -> float | None:
        """The input's time (`at=T`, `at=+T`), None when not given."""
        t = args.take("at")
        if t is None:
            return None
        return self.now + float(t[1:]) if t.startswith("+") else float(t)

    # ---- the machine under test --------------------------------------------------------------

    def do_node(self, args: Args) -> list[str]:
        timings = WATCHED if args.flag("watched") else TIMINGS
        fields = {f.name for f in dataclasses.fields(timings)}
        timings = dataclasses.replace(timings, **{k: value(args.kv.pop(k)) for k in list(args.kv) if k in fields})
        self.node = Node(live=args.take("live", N[1:4], peer_list), voters=args.take("voters", N[:4], peer_list),
                         timings=timings, wall=WALL if args.flag("wall") else 0.0)
        self.node.planner.reshape = self._reshape(self.node.planner.reshape)  # type: ignore[method-assign]
        return []

    def _reshape(self, plan):
        def reshape(view, cur, **kw):
            return plan(view, cur, **{**kw, "cut": frozenset()} if self.ignore_cut else kw)
        return reshape

    def do_peer(self, args: Args) -> list[str]:
        [me] = args.pos
        args.pos.clear()
        coordinator = args.take("coordinator", "n0")
        self.node, self.now, self.build, self.wait = None, 0.0, None, None
        self.peer = Peer(peer(me), coordinator=None if coordinator == "none" else peer(coordinator),
                         term=args.take("term", 1, int))
        return []

    def lines(self) -> list[str]:
        m = self.node if self.node is not None else self.peer
        assert m is not None
        out = list(m.lines)
        m.lines.clear()
        if self.node is not None:
            self.now = self.node.now
        return out

    # ---- the coordinator's inputs ------------------------------------------------------------

    @property
    def n(self) -> Node:
        assert self.node is not None
        return self.node

    def node_train_start(self, args: Args) -> list[str]:
        n = self.n
        key = args.pos.pop(0) if args.pos else "start"
        at = self.at(args) or 0.0
        run = args.take("run", RUN, RUNS.__getitem__)
        signed = args.take("signed", at, float)
        steps = args.take("steps", 100, int)
        n.planner.first = dataclasses.replace(PLACEMENT, spares=args.take("spares", (), peer_list))
        n.feed(self._start(key, run, signed, steps), at)
        if "first" in n.computes:
            n.compute("first", at)
        return self.lines()

    def _start(self, key, run, signed, steps):
        return StartRun(("op", key), start_op(run, steps=steps, at_s=self.n.wall + signed), DATA_HASH, DATA_NAME)

    def _op(self, kind: str, args: Args):
        """The operator's signed `kind` (the options of train-stop, -reschedule, -resume)."""
        at = self.at(args)
        signed = args.take("signed", self.now if at is None else at, float)
        run = args.take("run", RUN, RUNS.__getitem__)
        key = {"intruder": INTRUDER, "operator": OPERATOR}[args.take("by", "operator")]
        kind = args.take("as", kind)
        op = None if args.flag("unsigned") else sign_op(key, kind, now_s=self.n.wall + signed, run_id=run)
        return op, at

    def _operator(self, event, kind: str, args: Args) -> list[str]:
        key = args.pos.pop(0)
        op, at = self._op(kind, args)
        self.n.feed(event(("op", key), op), at)
        return self.lines()

    def node_train_stop(self, args: Args) -> list[str]:
        return self._operator(StopRun, "stop", args)

    def node_train_reschedule(self, args: Args) -> list[str]:
        return self._operator(Reschedule, "reschedule", args)

    def node_train_resume(self, args: Args) -> list[str]:
        return self._operator(ResumeRun, "resume", args)

    def node_answer(self, args: Args) -> list[str]:
        what = args.pos.pop(0)
        at = self.at(args)
        given: dict[bytes, dict] = {}
        everyone = None
        for k in list(args.kv):
            v = answer(args.kv.pop(k))
            if k == "*":
                everyone = v
            else:
                given |= {p: v for p in peer_list(k)}
        self.n.answer(what, given, at, everyone=everyone)
        return self.lines()

    def node_compute(self, args: Args) -> list[str]:
        self.n.compute(args.pos.pop(0) if args.pos else "plan", self.at(args))
        return self.lines()

    def node_tick(self, args: Args) -> list[str]:
        self.n.tick(float(args.pos.pop(0)) if args.pos else None)
        return self.lines()

    def node_trigger(self, args: Args) -> list[str]:
        self.n.feed(Trigger(args.pos.pop(0)), self.at(args))
        return self.lines()

    def node_report(self, args: Args) -> list[str]:
        """Each of PEERS reports step S (or steps A..B, in order), all at one time."""
        ps = peer_list(args.pos.pop(0))
        first, _, last = args.take("step").partition("..")
        epoch, at = args.take("epoch", 1, int), self.at(args)
        for step in range(int(first), int(last or first) + 1):
            for p in ps:
                self.n.feed(StepReported(p, RUN, report(epoch, step)), at)
        return self.lines()

    def node_step_failed(self, args: Args) -> list[str]:
        who, why = args.pos.pop(0), args.pos.pop(0)
        self.n.feed(StepFailed(peer(who), args.take("run", RUN, RUNS.__getitem__), args.take("epoch", 1, int), why),
                    self.at(args))
        return self.lines()

    def node_elected(self, args: Args) -> list[str]:
        self.n.feed(Elected(int(args.pos.pop(0))), self.at(args))
        return self.lines()

    def node_leave(self, args: Args) -> list[str]:
        self.n.feed(PeerLeaving(("leave", args.take("key", 1, value)), peer(args.pos.pop(0))), self.at(args))
        return self.lines()

    # ---- the coordinator's set-ups and world -------------------------------------------------

    def node_training(self, args: Args) -> list[str]:
        self.n.training(args.take("steps", 2, int), run_steps=args.take("run-steps", 100, int))
        self.now = self.n.now
        return []

    def node_local_epoch(self, args: Args) -> list[str]:
        self.n.local_epoch(allocation(args))
        return []

    def node_live(self, args: Args) -> list[str]:
        for w in args.pos:
            (self.n.swarm.live.add if w[0] == "+" else self.n.swarm.live.discard)(peer(w[1:]))
        args.pos.clear()
        return []

    def node_unmeasured(self, args: Args) -> list[str]:
        self.n.swarm.unmeasured = set(peer_list(" ".join(args.pos)))
        args.pos.clear()
        return []

    def node_planner(self, args: Args) -> list[str]:
        if not args.kv:
            pl = self.n.planner
            return ([f"first over {peers(c['peers'])}" + (f": {c['stages']} stages x {c['dp']}" if c["stages"] else "")
                     for c in pl.firsts]
                    + [f"reshape live {peers(c['live'])}, {c['remaining_steps']} steps left, seed {c['seed']}, "
                       f"force {c['force']}" + (f", cut {' '.join(peers(x).replace(' ', '-') for x in c['cut'])}"
                                                if "cut" in c else "") for c in pl.calls]) or ["no calls"]
        self.n.planner.kind = args.take("kind", self.n.planner.kind)
        self.n.planner.error = args.take("error", self.n.planner.error)
        self.ignore_cut = args.take("cut", "given") == "ignored"
        return []

    # ---- what the coordinator says of itself -------------------------------------------------

    def node_status(self, args: Args) -> list[str]:
        st = self.n.c.status()
        run = st.run_id.hex()[:8] if st.run_id else "none"
        out = [f"phase {st.phase.value}, run {run} epoch {st.epoch}, completed {st.completed} of {st.end_step}"]
        if st.reason:
            out.append(f"reason: {named(st.reason)}")
        if st.stalled_since is not None:
            out.append(f"stalled since {st.stalled_since:g}: {named(st.stalled_reason)}")
        if st.cut_links:
            out.append(f"cut links: {named(st.cut_links)}")
        for x in st.left_out:
            out.append(f"left out: {peers([x.peer])} {x.code} from {x.since:g} until {x.until:g}, {x.refusals} in a row")
        if st.kept_out:
            out.append(f"kept out (the run is not faster with them): {peers(st.kept_out)}")
        r = st.last_reconfig
        if r is not None:
            out.append(f"last reconfiguration: epoch {r.epoch} {r.kind} {r.old_shape} -> {r.new_shape} from step "
                       f"{r.resume_step}, restored from {r.restored_from}, {r.steps_lost} steps lost, "
                       f"{r.bytes_moved} bytes moved")
            out.append("  took " + ", ".join(f"{k} {round(getattr(r, k + '_s'), 3):g} s"
                                             for k in ("stop", "schedule", "offer", "transfer", "handout")))
        return out

    def node_epoch(self, args: Args) -> list[str]:
        return self._epoch(self.n.epoch)

    def _epoch(self, m) -> list[str]:
        """The epoch machine (n0's, or the peer's) as its status and queries say."""
        st = m.status()
        cur = m.current
        grid = (f" [{' | '.join(peers(p) for p in cur.pipelines)}]" + (f" spares {peers(cur.spares)}" if cur.spares
                                                                        else "")) if cur else ""
        out = [f"phase {st.phase.value if st.phase else None}, epoch {cur.epoch if cur else None}{grid}, step {st.step}"
               + (f", last report step {st.last_report.step}" if st.last_report else "")]
        if st.end is not None:
            out.append(f"ended after step {st.end.completed}: {named(st.end.reason)}"
                       + (" (failed)" if st.end.failed else ""))
        if st.last_end is not None:
            e = st.last_end
            out.append(f"last end: epoch {e['epoch']} after step {e['completed']}: {named(e['reason'])}"
                       + (" (failed)" if e["failed"] else ""))
        applied = " ".join(f"{r.hex()[:8]}@{t}/{ep}" for r, (t, ep) in sorted(m.applied.items())) or "-"
        out.append(f"run over {m.run_over()}, stopped by the operator {m.over_without_finishing(RUN)}, "
                   f"run stopped {st.run_stopped}, restored {st.restored}, applied {applied}"
                   + (f", heard {st.heard[0]} {st.heard[1]}" if st.heard else ""))
        return out

    def node_asks(self, args: Args) -> list[str]:
        return [f"asks: {', '.join(self.n.asks) or '-'}; computes: {', '.join(self.n.computes) or '-'}"]

    def node_deadline(self, args: Args) -> list[str]:
        return [f"next deadline {self.n.c.next_deadline():g}"]

    def node_refusals(self, args: Args) -> list[str]:
        return self._refusals(self.n.c.refusals)

    # ---- the epoch machine's inputs ----------------------------------------------------------

    @property
    def p(self) -> Peer:
        assert self.peer is not None
        return self.peer

    def _feed(self, event, args: Args) -> list[str]:
        at = self.at(args)
        self.now = self.now if at is None else at
        for a in self.p.feed(event, self.now):
            if isinstance(a, BuildStage):
                self.build = a
            if isinstance(a, WaitForCoordinator):
                self.wait = a
        return self.lines()

    def _context(self, args: Args) -> dict:
        return {k: peer_list(args.kv.pop(k)) for k in ("live", "known") if k in args.kv}

    def peer_offer(self, args: Args) -> list[str]:
        ctx = self._context(args)
        return self._feed(AllocationOffered(self.p.key("a"), allocation(args), context(self.p.me, **ctx)), args)

    def peer_accept(self, args: Args) -> list[str]:
        at = self.at(args)
        self.now = self.now if at is None else at
        self.p.accept(allocation(args), self.now)
        self.lines()
        return []

    def peer_built(self, args: Args) -> list[str]:
        assert self.build is not None
        a = self.build.alloc
        return self._feed(StageBuilt(self.build.key, a.epoch, a.start_step), args)

    def peer_build_failed(self, args: Args) -> list[str]:
        assert self.build is not None
        code, why = args.pos.pop(0), args.pos.pop(0)
        return self._feed(BuildFailed(self.build.key, self.build.alloc.epoch, code, why), args)

    def peer_start(self, args: Args) -> list[str]:
        return self._feed(StartAsked(self.p.key("s"), args.take("from", None, peer), args.take("run", RUN, RUNS.__getitem__),
                                     args.take("epoch", 1, int)), args)

    def peer_stop(self, args: Args) -> list[str]:
        event = StopAsked(self.p.key("t"), args.take("from", None, peer), args.take("run", RUN, RUNS.__getitem__),
                          args.take("before", None, int), abort=args.flag("abort"), epoch=args.take("epoch", None, int),
                          final=args.flag("final"), op=STOP if args.flag("signed") else None)
        return self._feed(event, args)

    def peer_step(self, args: Args) -> list[str]:
        return self._feed(StepDone(report(args.take("epoch", 1, int), int(args.pos.pop(0)))), args)

    def peer_runner_ended(self, args: Args) -> list[str]:
        epoch, completed, why = int(args.pos.pop(0)), int(args.pos.pop(0)), args.pos.pop(0)
        return self._feed(RunnerEnded(epoch, RunEnd(completed, why, args.flag("failed")), 1e9), args)

    def peer_epoch_done(self, args: Args) -> list[str]:
        return self._feed(EpochDone(int(args.pos.pop(0))), args)

    def peer_gone(self, args: Args) -> list[str]:
        who, why = args.pos.pop(0), args.pos.pop(0)
        return self._feed(MemberGone(peer(who), why), args)

    def peer_tick(self, args: Args) -> list[str]:
        if args.pos:
            args.kv["at"] = args.pos.pop(0)
        return self._feed(Tick(), args)

    def peer_again(self, args: Args) -> list[str]:
        """The allocation that waits for its coordinator, offered again (by default when its wait ends)."""
        assert self.wait is not None
        wait, self.wait = self.wait, None
        if "at" not in args.kv:
            args.kv["at"] = str(wait.until)
        return self._feed(wait.offer, args)

    def peer_restore(self, args: Args) -> list[str]:
        """The shell's restore of the allocation this peer applied last (and the step reports its
        checkpoints kept) after a restart."""
        kept = args.take("reports", [], reports)
        a = allocation(args)
        self.p.m.restore(RUN, a.term, a.epoch, a, kept)
        return []

    def peer_restored_ask(self, args: Args) -> list[str]:
        """Whether the restored run is to be asked about at time T (`restored_run_to_ask`)."""
        run = self.p.m.restored_run_to_ask(float(args.pos.pop(0)))
        return [f"ask about run {run.hex()[:8]}" if run else "ask nothing"]

    def peer_restored_heard(self, args: Args) -> list[str]:
        """The coordinator's account of the restored run: STATE, STEPS done (`restored_run_heard`)."""
        what, steps = args.pos.pop(0), int(args.pos.pop(0))
        self.p.m.restored_run_heard(args.take("run", RUN, RUNS.__getitem__), what, steps)
        return []

    # ---- what the epoch machine says of itself -----------------------------------------------

    def peer_stop_boundary(self, args: Args) -> list[str]:
        out = []
        for w in args.pos:
            out.append(f"after {w}: stop before step {self.p.m.stop_boundary(None if w == 'none' else int(w))}")
        args.pos.clear()
        return out

    def peer_epoch(self, args: Args) -> list[str]:
        return self._epoch(self.p.m)

    def peer_run_state(self, args: Args) -> list[str]:
        s = self.p.m.run_state(tuple(held(x) for x in args.pos))
        args.pos.clear()
        where = f"{s.layers[0]}-{s.layers[1]}" if s.layers else "-"
        return [f"run {s.run_id.hex()[:8] if s.run_id else None} term {s.term} epoch {s.epoch}: {where}@{s.at} "
                f"prev {s.prev}{' running' if s.running else ''}; checkpoints "
                f"{' '.join(f'{a}-{b}@{c}' for a, b, c in s.checkpoints) or '-'}; reports of steps "
                f"{' '.join(str(r.step) for r in s.reports) or '-'}"]

    def peer_held(self, args: Args) -> list[str]:
        out = []
        for w in args.pos:
            a, b, s = held(w)
            h = self.p.m.held_at(RUN, (a, b), s)
            out.append(f"{w}: " + (f"{h[0]} of epoch {h[1]}" if h else "nothing"))
        args.pos.clear()
        return out

    def peer_refusals(self, args: Args) -> list[str]:
        return self._refusals(self.p.m.refusals)

    # ---- both --------------------------------------------------------------------------------

    def do_election(self, args: Args) -> list[str]:
        e = (self.node or self.peer).election  # type: ignore[union-attr]
        if not args.kv:
            return [f"term {e.term}, coordinator {peers([e.coordinator]) if e.coordinator else None}, applied term "
                    f"{e.last_applied[0]} epoch {e.last_applied[1]}, voters {peers(e.voters)}"]
        e.term = args.take("term", e.term, int)
        if "coordinator" in args.kv:
            c = args.take("coordinator")
            e.coordinator = None if c == "none" else peer(c)
        if "applied" in args.kv:
            t, ep = args.take("applied").split("/")
            e.last_applied = (int(t), int(ep))
        return []

    def _refusals(self, refusals) -> list[str]:
        counts = refusals.counts()
        return [" ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"]

    def do_logs(self, args: Args) -> list[str]:
        out, self.caught.lines = self.caught.lines, []
        return out or ["nothing logged"]
