"""Operator operations: starting, stopping and rescheduling a run, signed by an operator key
that the swarm's configuration names (the swarm key file's operator lines, net/identity.py).

An `OperatorOp` is what an operator asks: the kind (start, stop, reschedule), the operator's
public key, the run (for a start: 16 fresh random bytes that become the new run's id, the
nonce that keeps a start from being taken twice), the wall-clock time it was signed, and for a
start the request (`TrainRequest`'s arguments; the data set by hash and name, never a path).
`SignedOp` is its canonical body (msgpack of a fixed-order list, the request's keys sorted) and
the operator's signature of `OPERATOR_DOMAIN + body`. The CLI signs (`dtfm-peer train`,
`dtfm-swarm`); every peer that acts on one checks it:

- the coordinator takes a start, a stop, a resume or a reschedule only when `check_op` accepts
  it (the kind, an operator of the swarm, a valid signature, the run it acts on) and its time is
  within the skew window (`check_time`), before any costly work (control/coordinator/machine.py);
  a stop, resume or reschedule also only when signed after the run's last resume or reschedule
  (`check_after`; the allocation carries that time) and not taken before (the operations this
  peer took, control/epoch/taken.py);
- a peer takes a run's final STOP only from the coordinator it recognises and only with the
  operator's signed stop of that run, by the same rules of time and replay
  (control/epoch/machine.py);
- every allocation carries the run's signed start, and a peer refuses one whose start is not an
  operator's, for another run, or for other data, preset, steps, seed, checkpoints or compression
  (`check_operator_start`, called by the epoch machine).

The rules are in docs/control.md ("Operators").
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Protocol

from dtfm.net import (
    PEER_ID_BYTES,
    ProtocolError,
    get_bytes,
    get_dict,
    pack,
    short_id,
    unpack_untrusted,
    verify_signature,
)

from .allocation import RUN_ID_BYTES, Allocation, Refusal
from .coordinator.request import KNOBS, TrainError, TrainRequest
from .election import COUNCIL_SIZES, MAX_COUNCIL, Council

__all__ = [
    "MAX_OP_BYTES", "OPERATOR_DOMAIN", "OP_KINDS", "OperatorError", "OperatorOp", "SignedOp", "check_after",
    "check_council", "check_op", "check_operator_start", "check_time", "council_arg", "root_council", "sign_op",
]

OPERATOR_DOMAIN = b"dtfm-operator-op-v1\x00"  # prefixed to the body before signing
OP_FORMAT = 1
OP_KINDS = ("start", "stop", "reschedule", "resume", "export", "council")
MAX_OP_BYTES = 4096  # a signed operation, as the allocation and TRAIN_OP carry it
MAX_ARGS = 32
DEFAULT_COUNCIL_SIZE = 5
MAX_TIME_MS = 2**53
SIGNATURE_BYTES = 64
# The arguments a signed start may carry (TrainRequest.to_args): nothing else, no path.
START_KEYS = frozenset({"preset", "steps", "seed", "stages", "dp", "checkpoint_every", "placement", "data_hash",
                        "data_name", "min_peers", "wait_s", "compress", "init_from", "init_name", "council", "council_size",
                        *KNOBS})


class OperatorError(Exception):
    """An operator operation that is refused, with the reason (for the operator and the log)."""


class Signer(Protocol):
    """An operator key as `sign_op` uses it (dtfm.net.OperatorKey)."""

    @property
    def public_key(self) -> bytes: ...

    def sign(self, data: bytes) -> bytes: ...


@dataclass(frozen=True)
class OperatorOp:
    """One operator operation (see the module docstring)."""

    kind: str  # start | stop | reschedule | resume | export | council
    operator: bytes  # the operator's Ed25519 public key
    run_id: bytes  # start: the new run's id (fresh random bytes); stop, reschedule, resume: the run
    issued_at_ms: int  # wall-clock milliseconds when it was signed
    # start: TrainRequest.to_args() and the first council; export: {"peer"}; council: {"council"}; else empty
    args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"operation kind must be one of {', '.join(OP_KINDS)}, got {self.kind!r}")
        if type(self.operator) is not bytes or len(self.operator) != PEER_ID_BYTES:
            raise ValueError("operator must be a 32-byte public key")
        if type(self.run_id) is not bytes or len(self.run_id) != RUN_ID_BYTES:
            raise ValueError(f"run_id must be {RUN_ID_BYTES} bytes")
        if type(self.issued_at_ms) is not int or not 0 <= self.issued_at_ms <= MAX_TIME_MS:
            raise ValueError(f"issued_at_ms must be an integer in [0, {MAX_TIME_MS}]")
        object.__setattr__(self, "args", dict(sorted(dict(self.args).items())))
        if self.kind == "start":
            self.request()
            if "council" in self.args:
                self.council()
        elif self.kind == "export":
            self.exporter()
        elif self.kind == "council":
            if not {"council"} <= set(self.args) <= {"council", "council_size"}:
                raise ValueError("a council operation names the council (args {\"council\": ids in hex, "
                                 "comma-separated, \"council_size\": 3, 5 or 7}) and nothing else")
            self.council()
        elif self.args:
            raise ValueError(f"a {self.kind} carries no arguments")

    def request(self) -> TrainRequest:
        """A start's request (ValueError when its arguments are not one)."""
        if len(self.args) > MAX_ARGS or not set(self.args) <= START_KEYS:
            raise ValueError(f"a start's arguments are {', '.join(sorted(START_KEYS))}, got "
                             f"{', '.join(sorted(map(str, self.args)))[:300]}")
        try:
            req = TrainRequest.from_args({k: v for k, v in self.args.items() if k not in ("council", "council_size")})
        except TrainError as e:
            raise ValueError(str(e)) from None
        if req.data_hash is None:
            raise ValueError("a start names its data set by hash (data_hash)")
        return req

    def exporter(self) -> bytes:
        """An export's one argument: the peer that may fetch the run's stages (ValueError)."""
        peer = self.args.get("peer")
        if set(self.args) != {"peer"} or type(peer) is not str or len(peer) != 2 * PEER_ID_BYTES \
                or not all(c in "0123456789abcdef" for c in peer):
            raise ValueError("an export names the peer that gathers the run (args {\"peer\": its id in hex}) "
                             "and nothing else")
        return bytes.fromhex(peer)

    def council(self) -> tuple[bytes, ...] | None:
        """The council a start or a council operation names (sorted; ValueError when it is not
        1 to MAX_COUNCIL distinct peer ids), None when it names none."""
        text = self.args.get("council")
        if text is None:
            return None
        if type(text) is not str or len(text) > MAX_COUNCIL * (2 * PEER_ID_BYTES + 1):
            raise ValueError(f"council: at most {MAX_COUNCIL} peer ids in hex, comma-separated")
        ids = text.split(",")
        if not 1 <= len(ids) <= MAX_COUNCIL or any(len(x) != 2 * PEER_ID_BYTES or x.strip("0123456789abcdef")
                                                   for x in ids):
            raise ValueError(f"council: 1 to {MAX_COUNCIL} peer ids in lowercase hex, comma-separated")
        voters = tuple(bytes.fromhex(x) for x in ids)
        if list(voters) != sorted(set(voters)):
            raise ValueError("council: the peer ids sorted, without repeats")
        size = self.args.get("council_size", DEFAULT_COUNCIL_SIZE)
        if size not in COUNCIL_SIZES or type(size) is not int:
            raise ValueError(f"council_size must be one of {', '.join(map(str, COUNCIL_SIZES))}, got {size!r}")
        if len(voters) > size:
            raise ValueError(f"council: {len(voters)} voters, more than its council_size {size}")
        return voters

    def council_size(self) -> int:
        """The council size a start or a council operation names (default 5)."""
        size = self.args.get("council_size", DEFAULT_COUNCIL_SIZE)
        assert type(size) is int
        return size

    @property
    def issued_at_s(self) -> float:
        return self.issued_at_ms / 1000

    def encode(self) -> bytes:
        """The canonical body: the same operation gives the same bytes on any machine."""
        return pack([OP_FORMAT, self.kind, self.operator, self.run_id, self.issued_at_ms, dict(self.args)])

    @classmethod
    def decode(cls, data: bytes) -> OperatorOp:
        """The operation in a body from the network; raises only ProtocolError."""
        obj = unpack_untrusted(data, max_len=MAX_OP_BYTES)
        if type(obj) is not list or len(obj) != 6:
            raise ProtocolError("operator operation: expected a list of 6 fields")
        version, kind, operator, run_id, at, args = obj
        if version != OP_FORMAT or type(version) is not int:
            raise ProtocolError(f"operator operation format {version!r}, this peer reads {OP_FORMAT}: "
                                "run the same dtfm version on every peer")
        if type(kind) is not str or type(operator) is not bytes or type(run_id) is not bytes or type(at) is not int:
            raise ProtocolError("operator operation: a field has the wrong type")
        if type(args) is not dict or len(args) > MAX_ARGS or not all(type(k) is str for k in args):
            raise ProtocolError("operator operation: arguments must be a small map with string keys")
        for v in args.values():
            if v is not None and type(v) not in (bool, int, float, str):
                raise ProtocolError("operator operation: an argument is not a plain value")
            if type(v) is float and not math.isfinite(v):
                raise ProtocolError("operator operation: an argument is not finite")
        try:
            op = cls(kind, operator, run_id, at, args)
        except ValueError as e:
            raise ProtocolError(f"operator operation: {e}") from None
        if op.encode() != bytes(data):
            raise ProtocolError("operator operation: body is not in its canonical encoding")
        return op


@dataclass(frozen=True)
class SignedOp:
    """An encoded operation and its operator's signature of OPERATOR_DOMAIN + body."""

    body: bytes
    signature: bytes

    @classmethod
    def sign(cls, op: OperatorOp, key: Signer) -> SignedOp:
        if key.public_key != op.operator:
            raise ValueError("the operation names another operator than the key that signs it")
        body = op.encode()
        return cls(body, key.sign(OPERATOR_DOMAIN + body))

    def open(self) -> OperatorOp:
        """The operation, once its operator's signature checks out; raises only ProtocolError
        (whether that operator is one of the swarm's is `check_op`'s question)."""
        op = OperatorOp.decode(self.body)
        if not verify_signature(op.operator, OPERATOR_DOMAIN + self.body, self.signature):
            raise ProtocolError(f"bad signature: the {op.kind} is not signed by operator {short_id(op.operator)}")
        return op

    def to_wire(self) -> dict:
        return {"body": self.body, "sig": self.signature}

    @classmethod
    def from_wire(cls, obj: object) -> SignedOp:
        d = get_dict(obj, "signed operator operation")
        return cls(get_bytes(d, "body", 1, MAX_OP_BYTES), get_bytes(d, "sig", SIGNATURE_BYTES, SIGNATURE_BYTES))

    def encode(self) -> bytes:
        """The form an allocation carries (`Allocation.operator_start`)."""
        return pack([self.body, self.signature])

    @classmethod
    def decode(cls, data: bytes) -> SignedOp:
        obj = unpack_untrusted(data, max_len=MAX_OP_BYTES + 128)
        if type(obj) is not list or len(obj) != 2:
            raise ProtocolError("signed operator operation: expected [body, signature]")
        return cls.from_wire({"body": obj[0], "sig": obj[1]})


def sign_op(key: Signer, kind: str, *, now_s: float, run_id: bytes | None = None,
            args: Mapping[str, Any] | None = None) -> SignedOp:
    """A signed operation of `kind` by `key`, dated `now_s` (wall clock); a start (or a council
    operation, which acts on no run) without `run_id` names fresh random bytes."""
    if run_id is None:
        if kind not in ("start", "council"):
            raise ValueError(f"a {kind} names the run it acts on")
        run_id = secrets.token_bytes(RUN_ID_BYTES)
    op = OperatorOp(kind, key.public_key, run_id, int(round(now_s * 1000)), dict(args or {}))
    return SignedOp.sign(op, key)


def check_op(signed: SignedOp | None, kind: str, operators: AbstractSet[bytes], *,
             run_id: bytes | None = None) -> OperatorOp:
    """The operation, when it is a `kind` signed by one of `operators` (for `run_id`, if given);
    else OperatorError with the reason. Pure and cheap: one signature check."""
    if signed is None:
        raise OperatorError(f"a {kind} must be signed by an operator of the swarm: none was given")
    try:
        op = signed.open()
    except ProtocolError as e:
        raise OperatorError(f"a {kind} with a bad operator signature: {e}") from None
    if op.kind != kind:
        raise OperatorError(f"a {kind} carries an operator's {op.kind}")
    if op.operator not in operators:
        raise OperatorError(f"the {kind} is signed by {short_id(op.operator)}, which is not an operator of this "
                            f"swarm ({_names(operators)}): the swarm key file lists the operators")
    if run_id is not None and op.run_id != run_id:
        raise OperatorError(f"the operator's {kind} is for run {op.run_id.hex()[:8]}, not run {run_id.hex()[:8]}")
    return op


def check_time(op: OperatorOp, now_s: float, skew_s: float, *, extra_s: float = 0.0) -> None:
    """OperatorError unless `op` was signed within `skew_s` (plus `extra_s` after) of `now_s`:
    an old operation is not taken again."""
    age = now_s - op.issued_at_s
    if age > skew_s + extra_s:
        raise OperatorError(f"the operator's {op.kind} was signed {age:.0f} s ago, more than the "
                            f"{skew_s + extra_s:g} s allowed: sign it again (are the clocks right?)")
    if age < -skew_s:
        raise OperatorError(f"the operator's {op.kind} is dated {-age:.0f} s in the future, more than the "
                            f"{skew_s:g} s clock skew allowed: check the clocks")


def council_arg(voters: tuple[bytes, ...] | list[bytes]) -> str:
    """The `council` argument of a start or a council operation naming `voters`."""
    return ",".join(v.hex() for v in sorted(set(voters)))


def root_council(signed: SignedOp, operators: AbstractSet[bytes]) -> Council:
    """The council an operator's signed start or council operation roots (OperatorError when
    it is no operator's, or names no council). Its time is the caller's to check where the
    root arrives on its own (a fresh root); one an allocation carries may be old."""
    try:
        op = signed.open()
    except ProtocolError as e:
        raise OperatorError(f"a council's root with a bad operator signature: {e}") from None
    if op.kind not in ("start", "council"):
        raise OperatorError(f"a council is rooted by an operator's start or council operation, not a {op.kind}")
    check_op(signed, op.kind, operators)
    voters = op.council()
    if voters is None:
        raise OperatorError(f"the operator's {op.kind} names no council")
    return Council(signed.encode(), voters, op.issued_at_ms, op.council_size())


def check_council(alloc: Allocation, operators: AbstractSet[bytes]) -> tuple[Council | None, Refusal | None]:
    """The council `alloc` carries, when its root is an operator's naming the root's voters and
    its voters are the allocation's (code `bad-council` otherwise). Whether its links follow
    from this peer's council is the election's question (`ElectionState.may_apply`)."""
    try:
        council = Council.decode(alloc.council)
        root = root_council(SignedOp.decode(council.root), operators)
    except (ProtocolError, OperatorError) as e:
        return None, Refusal("bad-council", f"the allocation's council: {e}"[:1000])
    if not root.same_root(council):
        return None, Refusal("bad-council", "the allocation's council names other voters or another time than "
                                            "its operator's root")
    if council.voters != alloc.voters:
        return None, Refusal("bad-council", "the allocation's voters are not its council's")
    return council, None


def check_after(op: OperatorOp, after_ms: int) -> None:
    """OperatorError unless `op` was signed after `after_ms`, the signed time of the run's last
    resume or reschedule that was taken (`Allocation.last_op_ms`; 0: none): an operation from
    before it belongs to an earlier part of the run's history (a copied stop cannot end the run
    once it was resumed, a copied resume or reschedule is not taken twice)."""
    if op.issued_at_ms <= after_ms:
        ago = (after_ms - op.issued_at_ms) / 1000
        raise OperatorError(f"the operator's {op.kind} is not newer than the run's last resume or reschedule, "
                            f"which was taken already ({ago:.0f} s later): sign a new one (are the clocks right?)")


def check_operator_start(alloc: Allocation, operators: AbstractSet[bytes]) -> Refusal | None:
    """None if `alloc` carries its run's start signed by one of `operators`, for its run, data,
    preset (a model folder's by its digest), steps, seed, training knobs, checkpoints and
    compression (the micro-batch count: the start's, or where the start left it to the
    scheduler, one it may choose for the allocation's pipelines); else why not (code
    `no-operator`)."""
    if not alloc.operator_start:
        return Refusal("no-operator", "the allocation carries no operator's signed start: only an operator "
                                      "of the swarm starts a run")
    try:
        signed = SignedOp.decode(alloc.operator_start)
    except ProtocolError as e:
        return Refusal("no-operator", f"the allocation's operator start is malformed: {e}"[:1000])
    try:
        op = check_op(signed, "start", operators, run_id=alloc.run_id)
        req = op.request()
    except (ProtocolError, OperatorError, ValueError) as e:
        return Refusal("no-operator", str(e)[:1000])
    diffs = [name for name, asked, got in (
        ("data", req.data_hash, alloc.data_hash), ("preset", req.preset, alloc.preset),
        ("steps", req.steps, alloc.end_step), ("seed", req.seed, alloc.train.seed),
        *((k, getattr(req.config, k), getattr(alloc.train, k)) for k in KNOBS if k != "micro_batches"),
        ("checkpoint_every", req.checkpoint_every, alloc.checkpoint_every),
        ("compression", req.compression, alloc.compression)) if asked != got]
    if not req.micro_batches_allowed(alloc.train.micro_batches, alloc.dp):  # (auto: a count the scheduler may choose)
        diffs.append("micro_batches")
    if diffs:
        return Refusal("no-operator", f"the allocation differs from the operator's start in {', '.join(diffs)}")
    return None


def _names(operators: AbstractSet[bytes]) -> str:
    if not operators:
        return "it names none"
    ids = sorted(short_id(p) for p in operators)
    return ", ".join(ids[:8]) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")
