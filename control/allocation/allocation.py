"""The signed allocation: who runs which stage of which model, for which run, and whether a
peer accepts it.

An `Allocation` names D pipelines of S peers, the S layer ranges, the model and training
configuration, the data set (by the sha256 of its tokens) and the steps to run. The issuer
signs its canonical encoding (msgpack of a fixed-order list, configuration maps with sorted
keys, floats as float64), prefixed with a domain tag; `Allocation.decode` accepts only that
canonical form, so one allocation has exactly one body and one signature check.

`check_allocation` is the pure decision a peer makes once `SignedAllocation.open` has checked
the signature: is everyone named alive, is this peer in it, is the model the one this peer
knows by that preset name, is the data the same, is it newer than what it already applied.

The grid (pipelines x layer ranges) is a `train.Plan`, which checks its shape; the bounds and
checks of the other fields, the holdings of the previous layout (`Holding`) and the wire form of
the configuration maps are in fields.py beside this module. The protocol is in docs/control.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields, replace

from dtfm.net import (
    PEER_ID_BYTES,
    Identity,
    ProtocolError,
    get_bool,
    get_bytes,
    get_dict,
    get_float,
    get_int,
    get_list,
    get_str,
    pack,
    short_id,
    unpack_untrusted,
    verify_signature,
)
from dtfm.train import CompressionConfig, GPTSpec, LinkCodecs, Plan, TrainConfig, check_compression, split_batch

from .fields import (
    MAX_COUNTER,
    MAX_DATA_NAME_LEN,
    MAX_ITERATION_S,
    MAX_LAYERS,
    MAX_NAMED,
    MAX_OPERATOR_START_BYTES,
    MAX_PEERS,
    MAX_PRESET_LEN,
    MAX_REASON_LEN,
    MAX_STAGES,
    RUN_ID_BYTES,
    SHA256_HEX,
    SIGNATURE_BYTES,
    Holding,
    check_bytes,
    check_int,
    check_str,
    config_from_wire,
    config_to_wire,
    layer_range_from_wire,
    peer_ids_from_wire,
)

__all__ = [
    "ALLOCATION_DOMAIN", "FORMATS", "FORMAT_VERSION", "MAX_ALLOCATION_BYTES", "REFUSAL_CODES",
    "AcceptContext", "Allocation", "Refusal", "SignedAllocation", "check_allocation",
]

ALLOCATION_DOMAIN = b"dtfm-allocation-v1\x00"  # prefixed to the body before signing
# First field of the body; a peer refuses a format it cannot read. Format 6 carries every
# field: the run's compression (an exact run's too), a per-link run's choice of which links and
# DP groups compress (`compress_links`, nil for any other run), the time of the run's last
# operator resume or reschedule (`last_op_ms`, 0: none) and the run's council (formats 3 to 5,
# without a council, are no longer read: every allocation names its council).
FORMAT_VERSION = 6
FORMATS = (6,)
MAX_COUNCIL_BYTES = 4096 + 128 + 1024 + 64 * 1024  # (control/election/council.py's bound)
MAX_OP_TIME_MS = 2**53  # an operator operation's signed time (control/operator.py MAX_TIME_MS)
MAX_ALLOCATION_BYTES = 1 << 18  # 4096 peer ids take ~140 KiB
MAX_CODE_LEN = 32

REFUSAL_CODES = ("stale", "not-member", "unknown-preset", "preset-mismatch", "data-mismatch",
                 "dead-peer", "unknown-peer", "not-covered")

_BODY_V3 = ("version", "run_id", "term", "epoch", "issuer", "preset", "model", "train", "pipelines",
            "layer_ranges", "spares", "data_hash", "data_name", "start_step", "end_step", "checkpoint_every",
            "predicted_iteration_s", "holdings", "absent", "reason", "voters", "operator_start")
_BODIES = {6: _BODY_V3 + ("compression", "compress_links", "last_op_ms", "council")}
_CODE = re.compile(r"[a-z][a-z-]*")


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """pipelines[d][s] runs stage s of pipeline d, which builds layers layer_ranges[s]."""

    epoch: int  # >= 1; grows with every new allocation of a run
    term: int  # the issuing coordinator's term; 0 until elections exist
    issuer: bytes  # peer id (Ed25519 public key) of the peer that signs it
    run_id: bytes  # 16 random bytes naming the run, so two runs' allocations never mix
    pipelines: tuple[tuple[bytes, ...], ...]  # D x S peer ids
    layer_ranges: tuple[tuple[int, int], ...]  # S contiguous ranges from 0 to model.n_layer
    preset: str  # model preset name; every peer must know it with the same spec
    model: GPTSpec
    train: TrainConfig
    data_hash: str  # sha256 hex of the corpus tokens (`Corpus.fingerprint`)
    data_name: str  # what the issuer's corpus is called, for error messages
    start_step: int  # the step to start from
    end_step: int  # train until this step, exclusive
    checkpoint_every: int = 0  # save each stage every K steps; 0: never
    predicted_iteration_s: float = 0.0  # the scheduler's predicted step time; 0: none
    spares: tuple[bytes, ...] = ()  # live peers given no stage
    # The previous layout's stages at start_step, where to fetch them and their digests; empty
    # when the run starts from fresh weights (start_step 0).
    holdings: tuple[Holding, ...] = ()
    absent: tuple[bytes, ...] = ()  # members the issuer could not reach: neither stage nor spare
    reason: str = ""  # why this epoch: "train start", "peer 3fa2c1d0 is dead", ...
    # The election's council from this epoch on (sorted; the issuer is one): `council`'s voters.
    voters: tuple[bytes, ...] = ()
    # The run's start as its operator signed it (control/operator.py `SignedOp.encode()`),
    # carried by every allocation of the run: each peer checks that an operator of the swarm
    # started it (`check_operator_start`). Empty: none, and peers refuse the allocation.
    operator_start: bytes = b""
    # How the run compresses activations and DP synchronisation (train/compress/); every peer
    # builds its stage with it, and the operator's start names the same. Exact: format 3.
    compression: CompressionConfig = CompressionConfig()
    # A per-link run's choice (compression.per_link, and only then): which pipeline links
    # (stage s -> s + 1 of pipeline d) use the run's pipeline codec and which stages' DP groups
    # its DP method; the others stay exact. Sender and receiver of a link read the same entry.
    compress_links: LinkCodecs | None = None
    # The wall-clock time (ms) an operator signed the run's last resume or reschedule that a
    # coordinator took; 0: none since the start. Every later allocation of the run carries it
    # (the newest), so any coordinator and every peer refuse a stop, resume or reschedule of the
    # run signed at or before it: a copied stop cannot end the run once it was resumed
    # (control/operator.py `check_after`, docs/security.md).
    last_op_ms: int = 0
    # The council's root (an operator's signed operation) and its changes since, one voter at a
    # time, each certified by a quorum of the council before (control/election/council.py,
    # `Council.encode()`): every peer checks that it follows from its own, a joiner from the root.
    council: bytes = b""
    # The grid as train.Plan holds it (this allocation's epoch); it checks the grid's shape.
    _plan: Plan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", tuple(tuple(p) for p in self.pipelines))
        object.__setattr__(self, "holdings", tuple(self.holdings))
        object.__setattr__(self, "absent", tuple(self.absent))
        object.__setattr__(self, "voters", tuple(self.voters))
        check_str("reason", self.reason, 0, MAX_REASON_LEN)
        if type(self.operator_start) is not bytes or len(self.operator_start) > MAX_OPERATOR_START_BYTES:
            raise ValueError(f"operator_start must be at most {MAX_OPERATOR_START_BYTES} bytes")
        if type(self.council) is not bytes or len(self.council) > MAX_COUNCIL_BYTES:
            raise ValueError(f"council must be at most {MAX_COUNCIL_BYTES} bytes")
        object.__setattr__(self, "layer_ranges", tuple(tuple(r) for r in self.layer_ranges))
        object.__setattr__(self, "spares", tuple(self.spares))
        check_int("epoch", self.epoch, 1, MAX_COUNTER)
        check_int("term", self.term, 0, MAX_COUNTER)
        check_bytes("issuer", self.issuer, PEER_ID_BYTES)
        check_bytes("run_id", self.run_id, RUN_ID_BYTES)
        check_str("preset", self.preset, 1, MAX_PRESET_LEN)
        check_str("data_name", self.data_name, 0, MAX_DATA_NAME_LEN)
        if type(self.data_hash) is not str or not SHA256_HEX.fullmatch(self.data_hash):
            raise ValueError(f"data_hash must be 64 lowercase hex characters, got {self.data_hash!r}")
        if not isinstance(self.model, GPTSpec):
            raise ValueError(f"model must be a GPTSpec, got {type(self.model).__name__}")
        if not isinstance(self.train, TrainConfig):
            raise ValueError(f"train must be a TrainConfig, got {type(self.train).__name__}")
        config_to_wire(self.model, "model")  # in the wire's bounds, so every allocation encodes
        config_to_wire(self.train, "train")
        if not isinstance(self.compression, CompressionConfig):
            raise ValueError(f"compression must be a CompressionConfig, got {type(self.compression).__name__}")
        config_to_wire(self.compression, "compression")
        if self.compress_links is not None and not isinstance(self.compress_links, LinkCodecs):
            raise ValueError(f"compress_links must be LinkCodecs, got {type(self.compress_links).__name__}")
        if self.compression.per_link != (self.compress_links is not None):
            raise ValueError("a per-link compression needs compress_links, and compress_links a per-link compression")
        check_int("start_step", self.start_step, 0, MAX_COUNTER)
        check_int("end_step", self.end_step, 1, MAX_COUNTER)
        if self.start_step >= self.end_step:
            raise ValueError(f"start_step {self.start_step} must come before end_step {self.end_step}")
        check_int("checkpoint_every", self.checkpoint_every, 0, MAX_COUNTER)
        check_int("last_op_ms", self.last_op_ms, 0, MAX_OP_TIME_MS)
        t = self.predicted_iteration_s
        if type(t) not in (int, float) or not math.isfinite(t) or not 0 <= t <= MAX_ITERATION_S:
            raise ValueError(f"predicted_iteration_s must be a number in [0, {MAX_ITERATION_S:g}], got {t!r}")
        object.__setattr__(self, "predicted_iteration_s", float(t))
        object.__setattr__(self, "_plan", self._grid())
        self._check_places()
        self._check_holdings()
        split_batch(self.train.global_batch_seqs, self.dp, self.train.micro_batches)
        self.train.warmups(self.stages)  # (one count per stage, TrainConfig checked the rest)
        check_compression(self.model, self._plan, self.compression)

    def _grid(self) -> Plan:
        """The grid: peer ids and layer indices within the wire's bounds, the shape as `Plan`
        checks it (one peer per stage of each pipeline, a peer in one place, layer ranges
        contiguous and non-empty from 0), and the model's layers covered."""
        if len(self.layer_ranges) > MAX_STAGES:
            raise ValueError(f"an allocation has at most {MAX_STAGES} stages, got {len(self.layer_ranges)}")
        peers = [x for p in self.pipelines for x in p]
        if len(peers) > MAX_PEERS:
            raise ValueError(f"more than {MAX_PEERS} peers")
        for x in peers:
            check_bytes("peer id", x, PEER_ID_BYTES)
        for r in self.layer_ranges:
            if len(r) != 2:
                raise ValueError(f"layer range {r!r} is not a pair")
            check_int("layer", r[0], 0, MAX_LAYERS)
            check_int("layer", r[1], 0, MAX_LAYERS)
        plan = Plan(self.pipelines, self.layer_ranges, self.epoch, self.compress_links)
        if plan.n_layer != self.model.n_layer:
            raise ValueError(f"layer ranges cover {plan.n_layer} layers, the model has {self.model.n_layer}")
        return plan

    def _check_places(self) -> None:
        """Spares, voters and absent peers: valid ids, each in one place at most."""
        peers = set(self.peers)
        if len(peers) + len(self.spares) > MAX_PEERS:
            raise ValueError(f"more than {MAX_PEERS} peers")
        for x in self.spares:
            check_bytes("peer id", x, PEER_ID_BYTES)
        if len(set(self.spares)) != len(self.spares):
            raise ValueError("a spare is listed twice")
        if set(self.spares) & peers:
            raise ValueError("a spare also holds a stage")
        if self.voters:
            if len(self.voters) > MAX_PEERS or list(self.voters) != sorted(set(self.voters)):
                raise ValueError("voters must be sorted, without repeats")
            for x in self.voters:
                check_bytes("voter", x, PEER_ID_BYTES)
            if self.issuer not in self.voters:
                raise ValueError("the issuer must be one of the voters")
        if len(self.absent) > MAX_PEERS:
            raise ValueError(f"more than {MAX_PEERS} absent peers")
        for x in self.absent:
            check_bytes("peer id", x, PEER_ID_BYTES)
        if set(self.absent) & (peers | set(self.spares)):
            raise ValueError("an absent peer also has a place")

    def _check_holdings(self) -> None:
        """The holdings, if any, cover the model's layers in contiguous ranges from 0."""
        if not self.holdings:
            return
        if len(self.holdings) > MAX_STAGES:
            raise ValueError(f"more than {MAX_STAGES} holdings")
        end = 0
        for h in self.holdings:
            if not isinstance(h, Holding):
                raise ValueError("holdings must be Holding values")
            if h.layer_range[0] != end or h.layer_range[1] <= end:
                raise ValueError("the holdings' layer ranges must be contiguous, non-empty, from 0")
            end = h.layer_range[1]
        if end != self.model.n_layer:
            raise ValueError(f"the holdings cover {end} layers, the model has {self.model.n_layer}")

    # ------------------------------------------------------------------ the grid

    @property
    def stages(self) -> int:
        return self._plan.stages

    @property
    def dp(self) -> int:
        return self._plan.dp

    @property
    def peers(self) -> tuple[bytes, ...]:
        """Every peer with a stage, pipeline by pipeline."""
        return tuple(x for p in self.pipelines for x in p)

    @property
    def configuration(self) -> tuple[bytes, ...]:
        """The voters from this epoch on."""
        return self.voters or tuple(sorted(set(self.peers) | set(self.spares)))

    @property
    def term_epoch(self) -> tuple[int, int]:
        """What orders allocations of one run: a newer term wins, then a newer epoch."""
        return (self.term, self.epoch)

    def position(self, peer: bytes) -> tuple[int, int]:
        """(pipeline, stage) of `peer`; KeyError if it holds no stage."""
        return self._plan.position(peer)

    def plan(self) -> Plan:
        """The grid, for the trainer: pipelines, layer ranges and this allocation's epoch."""
        return self._plan

    def neighbours(self, peer: bytes) -> frozenset[bytes]:
        """The peers `peer` exchanges tensors with in a step (train/worker.py, train/collective.py).

        Its whole pipeline: activations and gradients to the stages beside it, the gradient-norm
        all-reduce over the pipeline, the tied embedding between first and last stage. In its DP
        group: the ring all-reduce's two ring neighbours, and on the last stage, or with a
        compressed DP synchronisation (an all-gather), every member. A spare has none; KeyError
        for a peer not in the allocation."""
        if peer in self.spares:
            return frozenset()
        d, s = self.position(peer)
        out = set(self.pipelines[d])
        group = [p[s] for p in self.pipelines]
        if s == self.stages - 1 or (self.compression.dp_method != "exact" and self._plan.group_compressed(s)):
            out.update(group)
        else:
            out.update((group[(d - 1) % self.dp], group[(d + 1) % self.dp]))
        out.discard(peer)
        return frozenset(out)

    # ------------------------------------------------------------------ the wire

    def encode(self) -> bytes:
        """The canonical body: the same allocation gives the same bytes on any machine."""
        links = self.compress_links
        wire_links = None if links is None else [[list(row) for row in links.pp], list(links.dp)]
        extra = [config_to_wire(self.compression, "compression"), wire_links, self.last_op_ms, self.council]
        return pack([
            FORMAT_VERSION, self.run_id, self.term, self.epoch, self.issuer, self.preset,
            config_to_wire(self.model, "model"), config_to_wire(self.train, "train"),
            [list(p) for p in self.pipelines], [list(r) for r in self.layer_ranges], list(self.spares),
            self.data_hash, self.data_name, self.start_step, self.end_step, self.checkpoint_every,
            float(self.predicted_iteration_s), [h.to_wire() for h in self.holdings], list(self.absent),
            self.reason, list(self.voters), self.operator_start, *extra,
        ])

    @classmethod
    def decode(cls, data: bytes) -> Allocation:
        """The allocation in a body from the network; raises only ProtocolError."""
        obj = unpack_untrusted(data, max_len=MAX_ALLOCATION_BYTES)
        if type(obj) is not list or not obj:
            raise ProtocolError("allocation: expected a list of fields")
        version = get_int({"version": obj[0]}, "version", 0, MAX_COUNTER)
        body = _BODIES.get(version)
        if body is None:
            raise ProtocolError(f"allocation format {version}, this peer reads {', '.join(map(str, FORMATS))}: "
                                "run the same dtfm version on every peer")
        if len(obj) != len(body):
            raise ProtocolError(f"allocation: format {version} has {len(body)} fields, got {len(obj)}")
        d = dict(zip(body, obj))
        pipelines = tuple(tuple(peer_ids_from_wire(p, "pipeline", MAX_STAGES))
                          for p in get_list(d, "pipelines", MAX_PEERS))
        ranges = tuple(layer_range_from_wire(r) for r in get_list(d, "layer_ranges", MAX_STAGES))
        compression = (config_from_wire(CompressionConfig, d["compression"], "compression")
                       if "compression" in d else CompressionConfig())
        links = None
        if d.get("compress_links", None) is not None:  # (the per-link flag travels as this field's presence)
            links = _links_from_wire(d["compress_links"], len(ranges), len(pipelines))
            if compression.exact:
                raise ProtocolError("allocation: compress_links in an exact run")
            compression = replace(compression, per_link=True)
        try:
            alloc = cls(
                epoch=get_int(d, "epoch", 1, MAX_COUNTER), term=get_int(d, "term", 0, MAX_COUNTER),
                issuer=get_bytes(d, "issuer", PEER_ID_BYTES, PEER_ID_BYTES),
                run_id=get_bytes(d, "run_id", RUN_ID_BYTES, RUN_ID_BYTES),
                pipelines=pipelines, layer_ranges=ranges, preset=get_str(d, "preset", MAX_PRESET_LEN),
                model=config_from_wire(GPTSpec, d["model"], "model"),
                train=config_from_wire(TrainConfig, d["train"], "train"),
                data_hash=get_str(d, "data_hash", 64), data_name=get_str(d, "data_name", MAX_DATA_NAME_LEN),
                start_step=get_int(d, "start_step", 0, MAX_COUNTER), end_step=get_int(d, "end_step", 1, MAX_COUNTER),
                checkpoint_every=get_int(d, "checkpoint_every", 0, MAX_COUNTER),
                predicted_iteration_s=get_float(d, "predicted_iteration_s", 0.0, MAX_ITERATION_S),
                spares=tuple(peer_ids_from_wire(d["spares"], "spares", MAX_PEERS)),
                holdings=tuple(Holding.from_wire(h) for h in get_list(d, "holdings", MAX_STAGES)),
                absent=tuple(peer_ids_from_wire(d["absent"], "absent", MAX_PEERS)),
                reason=get_str(d, "reason", MAX_REASON_LEN),
                voters=tuple(peer_ids_from_wire(d["voters"], "voters", MAX_PEERS)),
                operator_start=get_bytes(d, "operator_start", 0, MAX_OPERATOR_START_BYTES),
                compression=compression, compress_links=links,
                last_op_ms=get_int(d, "last_op_ms", 0, MAX_OP_TIME_MS),
                council=get_bytes(d, "council", 0, MAX_COUNCIL_BYTES),
            )
        except (ValueError, TypeError) as e:
            raise ProtocolError(f"allocation: {e}") from None
        if alloc.encode() != bytes(data):
            raise ProtocolError("allocation: body is not in its canonical encoding")
        return alloc


def _links_from_wire(obj: object, stages: int, dp: int) -> LinkCodecs:
    """[[link s -> s + 1 of pipeline d, ...] per s, [group of stage s, ...]], every entry a
    boolean, shaped to the allocation's grid; raises only ProtocolError."""
    pair = get_list({"compress_links": obj}, "compress_links", 2)
    if len(pair) != 2:
        raise ProtocolError("allocation: compress_links must be [pipeline links, DP groups]")
    rows = get_list({"links": pair[0]}, "links", MAX_STAGES)
    groups = get_list({"groups": pair[1]}, "groups", MAX_STAGES)
    if len(rows) != max(stages - 1, 0) or len(groups) != stages:
        raise ProtocolError(f"allocation: compress_links must list {stages - 1} rows of links and {stages} groups "
                            f"for {stages} stages, got {len(rows)} and {len(groups)}")
    pp = []
    for row in rows:
        links = get_list({"links": row}, "links", MAX_PEERS)
        if len(links) != dp:
            raise ProtocolError(f"allocation: a row of compress_links must list {dp} links, got {len(links)}")
        pp.append(tuple(get_bool({"link": x}, "link") for x in links))
    return LinkCodecs(tuple(pp), tuple(get_bool({"group": x}, "group") for x in groups))


@dataclass(frozen=True)
class SignedAllocation:
    """An encoded allocation and its issuer's signature of ALLOCATION_DOMAIN + body."""

    body: bytes
    signature: bytes

    @classmethod
    def sign(cls, alloc: Allocation, identity: Identity) -> SignedAllocation:
        if identity.peer_id != alloc.issuer:
            raise ValueError(f"allocation names issuer {short_id(alloc.issuer)}, "
                             f"cannot be signed by {identity.short_id}")
        body = alloc.encode()
        return cls(body, identity.sign(ALLOCATION_DOMAIN + body))

    def open(self) -> Allocation:
        """The allocation, once its issuer's signature checks out; raises only ProtocolError."""
        alloc = Allocation.decode(self.body)
        if not verify_signature(alloc.issuer, ALLOCATION_DOMAIN + self.body, self.signature):
            raise ProtocolError(f"bad signature: allocation not signed by its issuer {short_id(alloc.issuer)}")
        return alloc

    def to_wire(self) -> dict:
        return {"body": self.body, "sig": self.signature}

    @classmethod
    def from_wire(cls, obj: object) -> SignedAllocation:
        d = get_dict(obj, "signed allocation")
        return cls(get_bytes(d, "body", 1, MAX_ALLOCATION_BYTES), get_bytes(d, "sig", SIGNATURE_BYTES, SIGNATURE_BYTES))


# ---------------------------------------------------------------------- acceptance


@dataclass(frozen=True)
class Refusal:
    """Why a peer refuses an allocation: a short machine code and a reason for the issuer."""

    code: str  # one of REFUSAL_CODES, or a code of the service that applies allocations
    reason: str

    def __post_init__(self) -> None:
        if type(self.code) is not str or len(self.code) > MAX_CODE_LEN or not _CODE.fullmatch(self.code):
            raise ValueError(f"bad refusal code {self.code!r}")
        check_str("reason", self.reason, 0, MAX_REASON_LEN)

    def to_wire(self) -> dict:
        return {"code": self.code, "reason": self.reason}

    @classmethod
    def from_wire(cls, obj: object) -> Refusal:
        d = get_dict(obj, "refusal")
        code, reason = get_str(d, "code", MAX_CODE_LEN), get_str(d, "reason", MAX_REASON_LEN)
        if not _CODE.fullmatch(code):
            raise ProtocolError(f"refusal: bad code {code!r}")
        return cls(code, reason)


@dataclass(frozen=True)
class AcceptContext:
    """What a peer knows when an allocation arrives."""

    me: bytes
    live: frozenset[bytes]  # members gossip says are alive; `me` is always counted
    known_presets: Mapping[str, GPTSpec]
    data_hash: str  # sha256 hex of this peer's corpus
    data_name: str  # what this peer's corpus is called
    applied: tuple[int, int] | None = None  # (term, epoch) last applied for run_id
    run_id: bytes | None = None  # the run `applied` belongs to
    known: frozenset[bytes] = field(default_factory=frozenset)  # every member heard of, alive or not

    def __post_init__(self) -> None:
        object.__setattr__(self, "live", frozenset(self.live) | {self.me})
        object.__setattr__(self, "known", frozenset(self.known) | self.live)


def check_allocation(alloc: Allocation, ctx: AcceptContext) -> Refusal | None:
    """None if this peer accepts `alloc` (its signature already checked), else why not."""
    named = set(alloc.peers) | set(alloc.spares)
    applied = ctx.applied
    if applied is not None and alloc.run_id == ctx.run_id and alloc.term_epoch <= tuple(applied):
        return _refuse("stale", f"term {alloc.term} epoch {alloc.epoch} is not newer than term {applied[0]} "
                                f"epoch {applied[1]}, already applied for this run")
    if ctx.me not in named:
        return _refuse("not-member", f"this peer ({short_id(ctx.me)}) has neither a stage nor a spare place")
    spec = ctx.known_presets.get(alloc.preset)
    if spec is None and alloc.preset.startswith("hf-"):  # (control/models.py: a model folder's digest)
        return _refuse("unknown-preset", f"the run trains the model folder of digest {alloc.preset[3:]}..., which "
                                         "this peer does not hold: copy the folder here and start the daemon "
                                         "with `--model-dir DIR`")
    if spec is None:
        return _refuse("unknown-preset", f"this peer knows no model preset {alloc.preset!r} (it knows "
                                         f"{', '.join(sorted(ctx.known_presets))}): run the same dtfm version")
    if spec != alloc.model:
        return _refuse("preset-mismatch", f"preset {alloc.preset!r} differs here in {_spec_diff(spec, alloc.model)}: "
                                          "run the same dtfm version on every peer")
    if alloc.data_hash != ctx.data_hash:
        return _refuse("data-mismatch", f"the run trains on {alloc.data_name[:100]!r} (sha256 {alloc.data_hash[:12]}), "
                                        f"this peer has {ctx.data_name[:100]!r} (sha256 {ctx.data_hash[:12]}): start "
                                        f"this daemon with `--data FILE` pointing at a copy of the issuer's file")
    dead = (named - ctx.live) & ctx.known
    if dead:
        return _refuse("dead-peer", f"peers not alive here: {_names(dead)}")
    unknown = named - ctx.known
    if unknown:
        return _refuse("unknown-peer", f"peers unknown here: {_names(unknown)}")
    uncovered = ctx.live - named - set(alloc.absent)
    if uncovered:
        return _refuse("not-covered", f"live peers with neither a stage nor a spare place: {_names(uncovered)}")
    return None


def _refuse(code: str, reason: str) -> Refusal:
    return Refusal(code, reason[:MAX_REASON_LEN])


def _names(peers: AbstractSet[bytes]) -> str:
    ids = sorted(short_id(p) for p in peers)
    more = f" and {len(ids) - MAX_NAMED} more" if len(ids) > MAX_NAMED else ""
    return ", ".join(ids[:MAX_NAMED]) + more


def _spec_diff(mine: GPTSpec, theirs: GPTSpec) -> str:
    diffs = [f"{f.name} (here {getattr(mine, f.name)!r}, allocation {getattr(theirs, f.name)!r})"
             for f in fields(GPTSpec) if getattr(mine, f.name) != getattr(theirs, f.name)]
    return "; ".join(diffs)


