"""What the machine tests share (tests/control/epoch/test_epoch_machine.py, tests/control/coordinator/test_coordinator_machine.py):
six named peers, allocations among them, an election the test sets by hand, and each action of
a machine written as one line, so a test can compare what a machine did with a transcript.

The peers are named n0 .. n5 in the order of their ids (the order the machines sort them in);
`named` puts those names in place of the short ids inside reasons.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from dtfm.control import (
    KNOBS,
    AcceptContext,
    Allocation,
    ControlMsg,
    PeerRunState,
    Refusal,
    SignedAllocation,
    SignedOp,
    StepReport,
    council_arg,
    root_council,
    sign_op,
)
from dtfm.control.election import Certificate, Council, CouncilLink, config_digest, vote_payload
from dtfm.control.election.council import change_refusal, link_payload
from dtfm.control.actions import Answers, Ask, Compute, Computed, Emit, LogLine, Reply, ResetLog, Send
from dtfm.control.answers import AllocationAnswer, KeepAnswer, OfferAnswer, PeerAnswer, StartAnswer, StopAnswer
from dtfm.control.coordinator import machine as c
from dtfm.control.epoch import machine as e
from dtfm.control.epoch.machine import (
    AbortRunner,
    ApplyToElection,
    BuildStage,
    EndEpoch,
    FailNeighbour,
    KeepStage,
    PersistApplied,
    StartRunner,
    StopRunnerAt,
    WaitForCoordinator,
)
from dtfm.control.reach import ReachAnswer
from dtfm.net import Identity, OperatorKey, short_id
from dtfm.train import PRESETS, TEST_CONFIG, TrainConfig

KEYS = sorted((Identity(bytes([i]) * 32) for i in range(1, 7)), key=lambda k: k.peer_id)
N = [k.peer_id for k in KEYS]  # n0 .. n5
NAMES = {p: f"n{i}" for i, p in enumerate(N)}
KEY_OF = {k.peer_id: k for k in KEYS}
RUN = b"r" * 16
CFG = dataclasses.replace(TEST_CONFIG, micro_batches=2)
CFG_KNOBS = {k: getattr(CFG, k) for k in KNOBS if getattr(CFG, k) != getattr(TrainConfig(), k)}
DATA_HASH = "ab" * 32
DATA_NAME = "corpus.txt"
TINY = PRESETS["tiny"]  # 4 layers: two stages of two
OPERATOR = OperatorKey(b"\x07" * 32)  # the swarm's operator
OPERATORS = frozenset({OPERATOR.public_key})
INTRUDER = OperatorKey(b"\x08" * 32)  # a key the swarm does not name


def start_op(run: bytes = RUN, *, steps: int = 100, seed: int = CFG.seed, checkpoint_every: int = 0,
             data_hash: str = DATA_HASH, at_s: float = 0.0, key: OperatorKey = OPERATOR, **args) -> SignedOp:
    """The operator's signed start of `run` (tiny, by default what `alloc()` runs: CFG's knobs)."""
    request = {"preset": "tiny", "steps": steps, "seed": seed, "checkpoint_every": checkpoint_every,
               "placement": "scheduler", "data_hash": data_hash, "data_name": DATA_NAME, **CFG_KNOBS, **args}
    return sign_op(key, "start", now_s=at_s, run_id=run, args=request)


def alloc(**kw) -> Allocation:
    """Term 1 epoch 1 of RUN, issued by n0: pipelines [n0 n1] and [n2 n3], layers 0-2 and 2-4;
    it carries the operator's start of its run (its steps, seed, knobs, checkpoints, data and compression)."""
    fields: dict = {
        "epoch": 1, "term": 1, "issuer": N[0], "run_id": RUN, "pipelines": ((N[0], N[1]), (N[2], N[3])),
        "layer_ranges": ((0, 2), (2, 4)), "preset": "tiny", "model": TINY, "train": CFG, "data_hash": DATA_HASH,
        "data_name": DATA_NAME, "start_step": 0, "end_step": 100}
    fields |= kw
    if "council" not in kw:
        named = {p for pipe in fields["pipelines"] for p in pipe} | set(fields.get("spares", ()))
        voters = tuple(fields.get("voters") or sorted(named)[:7])
        if fields["issuer"] not in voters:
            voters = tuple(sorted(voters[:6] + (fields["issuer"],)))
        fields["voters"] = voters
        fields["council"] = root_of(voters).encode()
    if "operator_start" not in kw:
        comp = fields.get("compression")
        knobs = {k: getattr(fields["train"], k) for k in KNOBS}
        fields["operator_start"] = start_op(fields["run_id"], steps=fields["end_step"], seed=fields["train"].seed,
                                            checkpoint_every=fields.get("checkpoint_every", 0),
                                            data_hash=fields["data_hash"],
                                            **({"compress": comp.to_spec()} if comp and not comp.exact else {}),
                                            **knobs).encode()
    return Allocation(**fields)


_ROOTS: dict[tuple[bytes, ...], Council] = {}


def root_of(voters: tuple[bytes, ...]) -> Council:
    """The council of `voters` as the operator roots it (a council operation, one per set of voters)."""
    voters = tuple(sorted(voters))
    if voters not in _ROOTS:
        size = 5 if len(voters) <= 5 else 7
        signed = sign_op(OPERATOR, "council", now_s=0.0, run_id=b"c" * 16,
                         args={"council": council_arg(voters), "council_size": size})
        _ROOTS[voters] = root_council(signed, OPERATORS)
    return _ROOTS[voters]


def context(me: bytes, live=tuple(N[:4]), known=None, data_hash: str = DATA_HASH) -> AcceptContext:
    """What `me` knows when an allocation arrives: `live` members (every peer of `known`, by
    default the six, is heard of)."""
    return AcceptContext(me=me, live=frozenset(live), known_presets=PRESETS, data_hash=data_hash,
                         data_name="mine.txt", known=frozenset(N if known is None else known))


def report(epoch: int, step: int, loss: float | None = None) -> StepReport:
    return StepReport(epoch, step, round(5.0 - step / 10, 2) if loss is None else loss, 1.0, 0.5, 0.3, 0.2)


@dataclass
class FakeElection:
    """The election as the machines read it (`ElectionView`), set by the test; `may_apply` is
    the election's own rule (control/election/state.py) but for the certificate, which the
    machines only pass on."""

    me: bytes
    term: int = 1
    coordinator: bytes | None = None
    voters: tuple[bytes, ...] = ()
    last_applied: tuple[int, int] = (0, 0)
    council: Council | None = None  # the operator's root of `voters` unless given

    def __post_init__(self) -> None:
        if self.voters and self.council is None:
            self.council = root_of(self.voters)

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator == self.me

    @property
    def is_follower(self) -> bool:
        return self.coordinator is not None and self.coordinator != self.me

    @property
    def certificate(self):
        return None  # the machines only carry it; tests/control/election/test_election.py checks it

    def council_for(self, voters, epoch: int) -> Council | None:
        """The council with one change to `voters` signed by this peer over a certificate of
        every voter (the election's rule, state.py `council_for`, without its coordinator's role)."""
        voters = tuple(sorted(voters))
        c = self.council
        if c is None:
            return None
        if voters == c.voters:
            return c
        if change_refusal(c.voters, voters) is not None or (len(voters) > len(c.voters) >= c.size):
            return None
        payload = vote_payload(self.term, self.me, config_digest(c.voters))
        cert = Certificate.of(self.term, self.me, c.voters, {v: KEY_OF[v].sign(payload) for v in c.voters})
        sig = KEY_OF[self.me].sign(link_payload(self.term, epoch, c.voters, voters))
        return c.extended(CouncilLink(cert, voters, sig, epoch))

    def may_apply(self, issuer: bytes, term: int, epoch: int, certificate=None, council=None) -> Refusal | None:
        if term < self.term:
            return Refusal("stale", f"term {term} is older than this peer's term {self.term}")
        if term > self.term or self.coordinator is None:
            return Refusal("not-coordinator", f"this peer knows no coordinator of term {term} yet")
        if issuer != self.coordinator:
            return Refusal("not-coordinator", f"{short_id(issuer)} is not the coordinator of term {term}")
        if (term, epoch) <= self.last_applied:
            return Refusal("stale", f"term {term} epoch {epoch} is not newer than {self.last_applied}")
        return None

    def apply(self, a: ApplyToElection) -> None:
        """What the shell does with ApplyToElection."""
        assert (a.term, a.epoch) > self.last_applied
        self.last_applied = (a.term, a.epoch)
        self.voters = a.council.voters
        self.council = a.council


# ---- actions as lines ----------------------------------------------------------------------------


def named(text: str) -> str:
    for p, name in NAMES.items():
        text = text.replace(short_id(p), name)
    return text


def peers(ps) -> str:
    return " ".join(NAMES.get(p, short_id(p)) for p in ps)


def label(key) -> str:
    """A request's key as the transcript names it: the coordinator's as it prints itself
    (control/coordinator/keys.py: a procedure's by its step), a test's own tuple joined."""
    if not isinstance(key, tuple):
        return str(key)
    return " ".join(str(k) for k in key)


def show_alloc(a: Allocation) -> str:
    grid = " | ".join(peers(p) for p in a.pipelines)
    out = f"term {a.term} epoch {a.epoch} steps {a.start_step}..{a.end_step} [{grid}]"
    if a.spares:
        out += f" spares {peers(a.spares)}"
    if a.holdings:
        out += " holdings " + " ".join(f"{h.layer_range[0]}-{h.layer_range[1]}:{h.digest[:8]}@{peers(h.holders)}"
                                       for h in a.holdings)
    out += f" voters {peers(a.configuration)}"
    if a.absent:
        out += f" absent {peers(a.absent)}"
    return out


def _body(msg: int, body: dict) -> str:
    if msg == ControlMsg.STEP:
        return " ".join(f"{k}={body[k]}" for k in ("epoch", "step", "loss", "failed") if k in body)
    if msg == ControlMsg.ALLOCATION:
        return show_alloc(SignedAllocation.from_wire(body).open())
    if msg == ControlMsg.RUN_STATE and body.get("op") == "offer":
        a, b = body["layers"]
        return f"offer step={body['step']} layers={a}-{b}"
    if msg == ControlMsg.RUN_STATE and body.get("op") == "reach":
        return f"reach {peers(body['peers'])} within {body['timeout_s']:g} s"
    if msg == ControlMsg.STOP and "op" in body:
        return " ".join(f"{k}={v}" for k, v in body.items() if k not in ("run", "op")) + " signed"
    return " ".join(f"{k}={v}" for k, v in body.items() if k not in ("run", "op")) or str(body.get("op", ""))


def _value(v) -> str:
    if isinstance(v, Allocation):
        return f"allocation term {v.term} epoch {v.epoch}"
    if isinstance(v, dict) and "new_shape" in v:  # a reconfiguration's record (a leave's says if it handed off)
        return " ".join(f"{f}={named(str(v[f]))}" for f in (*EMIT_FIELDS, "handed_off") if f in v)
    if isinstance(v, dict):
        reason = v.get("reason")
        shown = " ".join(f"{k}={x}" for k, x in v.items() if k != "reason")
        return shown + (f" ({named(reason)})" if reason is not None else "")
    return repr(v)


EMIT_FIELDS = ("term", "epoch", "trigger", "old_shape", "new_shape", "kind", "resume_step", "rollback", "reason")


def show(a: object, *, keys: bool = True) -> str:
    """One action as a line of the transcript (`keys`: with the key a Reply answers)."""
    if isinstance(a, Ask):
        return f"ask {label(a.key)}: {ControlMsg(a.msg).name} {_body(a.msg, a.body)} -> {peers(a.peers)}"
    if isinstance(a, Send):
        return f"send {ControlMsg(a.msg).name} to {peers([a.peer])}: {named(_body(a.msg, a.body))}"
    if isinstance(a, Compute):
        return f"compute {label(a.key)}"
    if isinstance(a, LogLine):
        x = a.line
        flags = "".join(f" {f}" for f in ("partial", "backfilled") if x.get(f))
        return f"log step {x['step']} loss {x['loss']} epoch {x['epoch']}{flags}"
    if isinstance(a, ResetLog):
        return "reset log"
    if isinstance(a, Emit):
        shown = " ".join(f"{f}={named(str(a.fields[f]))}" for f in EMIT_FIELDS if f in a.fields)
        if a.fields.get("rollback"):  # where the stages came from, and the completed steps run again
            shown += f" restored_from={a.fields['restored_from']} steps_lost={a.fields['steps_lost']}"
        return f"emit {a.event} {shown}".rstrip()
    if isinstance(a, Reply):
        to = f" {label(a.key)}" if keys else ""
        value = a.value.to_wire() if isinstance(a.value, AllocationAnswer | StartAnswer | StopAnswer) else a.value
        if a.error is not None and not isinstance(value, dict):
            return f"reply{to}: error ({named(a.error)})"
        return f"reply{to}: {_value(value)}"
    if isinstance(a, WaitForCoordinator):
        return f"wait for the coordinator until {a.until:g}"
    if isinstance(a, EndEpoch):
        return f"end epoch {a.epoch} ({a.reason})"
    if isinstance(a, PersistApplied):
        return f"persist term {a.alloc.term} epoch {a.alloc.epoch}"
    if isinstance(a, ApplyToElection):
        return f"apply term {a.term} epoch {a.epoch} voters {peers(a.council.voters)}"
    if isinstance(a, BuildStage):
        return f"build epoch {a.alloc.epoch} from " + (f"epoch {a.prev.epoch}" if a.prev is not None else "nothing")
    if isinstance(a, StartRunner):
        return f"start runner of epoch {a.epoch}"
    if isinstance(a, StopRunnerAt):
        return f"stop runner of epoch {a.epoch} before step {a.step}"
    if isinstance(a, AbortRunner):
        return f"abort runner ({named(a.reason)})"
    if isinstance(a, FailNeighbour):
        return f"fail neighbour {peers([a.peer])} ({a.why})"
    if isinstance(a, KeepStage):
        return f"keep the stage of run {a.run_id.hex()[:8]} on disk"
    raise AssertionError(f"no line for {a!r}")


def _answer(peer: bytes, a: PeerAnswer) -> str:
    name = NAMES.get(peer, short_id(peer))
    if isinstance(a, PeerRunState):
        where = "-" if a.layers is None else f"{a.layers[0]}-{a.layers[1]}"
        return f"{name} {where}@{a.at}{' running' if a.running else ''}"
    if isinstance(a, AllocationAnswer):
        return f"{name} {'' if a.accepted else 'not '}accepted"
    if isinstance(a, StartAnswer):
        return f"{name} {'' if a.started else 'not '}started"
    if isinstance(a, StopAnswer):
        return f"{name} {'' if a.stopped else 'not '}stopped"
    if isinstance(a, OfferAnswer) and a.digest is not None:
        return f"{name} {a.digest[:8]}"
    if isinstance(a, ReachAnswer):
        return f"{name} reached {peers(a.reached) or '-'}" + (f" not {peers(a.unreached)}" if a.unreached else "")
    if isinstance(a, OfferAnswer | KeepAnswer) and a.reason is not None:
        return f"{name} error"
    return f"{name} -"


def describe(ev: object) -> str:
    """One input of a machine (an event of either) as a line of the transcript."""
    if isinstance(ev, e.AllocationOffered):
        a = ev.alloc
        return (f"ALLOCATION term {a.term} epoch {a.epoch} from {peers([a.issuer])}"
                + (f" (again, waited until {ev.waited_until:g})" if ev.waited_until is not None else ""))
    if isinstance(ev, e.StageBuilt):
        return f"stage of epoch {ev.epoch} built at step {ev.at}"
    if isinstance(ev, e.BuildFailed):
        return f"building epoch {ev.epoch} failed: {ev.code}"
    if isinstance(ev, e.StartAsked):
        return f"START epoch {ev.epoch} from {peers([ev.sender])}"
    if isinstance(ev, e.StopAsked):
        how = "".join(f" {f}" for f in ("final", "abort") if getattr(ev, f))
        signed = " (signed)" if ev.op is not None else ""
        return f"STOP before step {ev.at_step}{how}{signed} from {peers([ev.sender])}"
    if isinstance(ev, e.StepDone):
        return f"step {ev.report.step} of epoch {ev.report.epoch} done"
    if isinstance(ev, e.RunnerEnded):
        return f"runner of epoch {ev.epoch} ended after step {ev.end.completed}: {ev.end.reason}"
    if isinstance(ev, e.EpochDone):
        return f"epoch {ev.epoch} let go of its stage"
    if isinstance(ev, e.MemberGone):
        return f"{peers([ev.peer])} is gone"
    if isinstance(ev, e.EpochTick | c.CoordinatorTick):
        return "tick"
    if isinstance(ev, c.Wake):
        return "wake"
    if isinstance(ev, c.Trigger):
        return f"trigger: {named(ev.reason)}"
    if isinstance(ev, c.StepReported):
        return f"STEP {ev.report.step} of epoch {ev.report.epoch} from {peers([ev.peer])}"
    if isinstance(ev, c.StepFailed):
        return f"STEP of epoch {ev.epoch} failed at {peers([ev.peer])}: {ev.reason}"
    if isinstance(ev, c.Elected):
        return f"elected in term {ev.term}"
    if isinstance(ev, c.SteppedDownEvent):
        return f"stepped down in term {ev.term}"
    if isinstance(ev, c.StartRun):
        return "train start"
    if isinstance(ev, c.Reschedule):
        return "train reschedule"
    if isinstance(ev, c.StopRun):
        return "train stop"
    if isinstance(ev, c.ResumeRun):
        return "train resume"
    if isinstance(ev, c.PeerLeaving):
        return f"LEAVE from {peers([ev.peer])}"
    if isinstance(ev, Answers):
        return f"answers {label(ev.key)}: " + ", ".join(_answer(p, a) for p, a in sorted(ev.answers.items()))
    if isinstance(ev, Computed):
        return f"computed {label(ev.key)}" + (f": error ({ev.error})" if ev.error is not None else "")
    return repr(ev)


def same_transcript(got: list[str], want: str) -> None:
    """Compare a transcript with the expected one (indentation of `want` is ignored); a
    mismatch fails with the diff."""
    want_lines = [x.strip() for x in want.strip().splitlines() if x.strip()]
    got_lines = [x.strip() for x in got]
    if got_lines != want_lines:
        diff = "\n".join(difflib.unified_diff(want_lines, got_lines, "expected", "got", lineterm=""))
        raise AssertionError(f"the transcript differs:\n{diff}")
