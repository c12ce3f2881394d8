"""The signed allocation: canonical codec, signature, acceptance, and the neighbour rule
checked against the messages of a real in-process training step."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.control.allocation import (
    ALLOCATION_DOMAIN,
    FORMAT_VERSION,
    MAX_ALLOCATION_BYTES,
    REFUSAL_CODES,
    AcceptContext,
    Allocation,
    Holding,
    Refusal,
    SignedAllocation,
    check_allocation,
)
from dtfm.control.allocation.allocation import FORMATS, MAX_COUNCIL_BYTES
from dtfm.control.election.council import MAX_COUNCIL_BYTES as COUNCIL_BYTES
from dtfm.net import Identity, ProtocolError, pack, short_id, unpack_untrusted
from dtfm.train import (
    PRESETS,
    TEST_CONFIG,
    CompressionConfig,
    GPTSpec,
    InMemoryComm,
    InMemoryHub,
    LinkCodecs,
    LocalCluster,
    Plan,
    TrainConfig,
    load_corpus,
    parse_compression,
)

IDENTITIES = [Identity(bytes([i]) * 32) for i in range(1, 14)]
IDS = [i.peer_id for i in IDENTITIES]
ISSUER = IDENTITIES[0]
MALLORY = Identity(b"\xee" * 32)
DATA_HASH = hashlib.sha256(b"the issuer's corpus").hexdigest()
OTHER_HASH = hashlib.sha256(b"another corpus").hexdigest()
RUN = bytes(range(16))
TINY = PRESETS["tiny"]
CFG = dataclasses.replace(TEST_CONFIG, micro_batches=2)  # 8 sequences: up to 4 pipelines

wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


def even_ranges(n_layer: int, stages: int) -> list[tuple[int, int]]:
    cuts = [n_layer * s // stages for s in range(stages + 1)]
    return list(itertools.pairwise(cuts))


def make(d: int = 2, s: int = 2, spares: int = 0, **kw) -> Allocation:
    """D x S peers from IDS (the issuer holds stage 0 of pipeline 0), then `spares` more."""
    fields = {
        "epoch": 3, "term": 1, "issuer": ISSUER.peer_id, "run_id": RUN,
        "pipelines": [IDS[k * s:(k + 1) * s] for k in range(d)], "layer_ranges": even_ranges(TINY.n_layer, s),
        "preset": "tiny", "model": TINY, "train": CFG, "data_hash": DATA_HASH, "data_name": "corpus.txt",
        "start_step": 5, "end_step": 100, "checkpoint_every": 10, "predicted_iteration_s": 1.25,
        "spares": IDS[d * s:d * s + spares],
    }
    fields.update(kw)
    return Allocation(**fields)


def body_list(alloc: Allocation) -> list:
    return unpack_untrusted(alloc.encode(), max_len=MAX_ALLOCATION_BYTES)


def _with(body: list, index: int, value) -> bytes:
    body = list(body)
    body[index] = value
    return pack(body)


OP_MS = 1_700_000_123_456  # an operator's resume, signed then (ms)


# ---------------------------------------------------------------------- codec and signature


def test_round_trip_encode_decode_and_sign_open():
    a = make(spares=2)
    assert Allocation.decode(a.encode()) == a
    signed = SignedAllocation.sign(a, ISSUER)
    wire = unpack_untrusted(pack(signed.to_wire()), max_len=1 << 20)
    assert SignedAllocation.from_wire(wire) == signed
    assert SignedAllocation.from_wire(wire).open() == a


def test_helpers_describe_the_grid():
    a = make(d=3, s=2, spares=1)
    assert (a.dp, a.stages, a.peers) == (3, 2, tuple(IDS[:6]))
    assert a.position(IDS[3]) == (1, 1)
    assert a.term_epoch == (1, 3)
    assert a.neighbours(IDS[6]) == frozenset()  # the spare
    with pytest.raises(KeyError):
        a.position(IDS[7])
    with pytest.raises(KeyError):
        a.neighbours(IDS[7])


@st.composite
def allocation_fields(draw) -> dict:
    d, s, n_spares = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(0, 3))
    n_layer = draw(st.integers(s, s + 4))
    cuts = sorted(draw(st.sets(st.integers(1, max(n_layer - 1, 1)), min_size=s - 1, max_size=s - 1)))
    ids = draw(st.lists(st.binary(min_size=32, max_size=32), min_size=d * s + n_spares,
                        max_size=d * s + n_spares, unique=True))
    n_head = draw(st.integers(1, 4))
    model = GPTSpec(draw(st.text(max_size=12)), n_layer=n_layer, n_embd=n_head * draw(st.integers(1, 8)),
                    n_head=n_head, seq_len=draw(st.integers(1, 64)), tied_head=draw(st.booleans()))
    micro = draw(st.integers(1, 3))
    train = TrainConfig(seed=draw(st.integers(0, 2**32)), global_batch_seqs=draw(st.integers(d * micro, 64)),
                        micro_batches=micro, lr=draw(st.floats(1e-6, 1.0)),
                        wire_dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"])))
    start = draw(st.integers(0, 2**40))
    return {
        "epoch": draw(st.integers(1, 2**63 - 1)), "term": draw(st.integers(0, 2**63 - 1)),
        "issuer": draw(st.sampled_from(ids)), "run_id": draw(st.binary(min_size=16, max_size=16)),
        "pipelines": [ids[k * s:(k + 1) * s] for k in range(d)],
        "layer_ranges": list(zip([0, *cuts], [*cuts, n_layer])), "preset": draw(st.text(min_size=1, max_size=10)),
        "model": model, "train": train, "data_hash": draw(st.binary(min_size=32, max_size=32)).hex(),
        "data_name": draw(st.text(max_size=30)), "start_step": start, "end_step": start + draw(st.integers(1, 2**20)),
        "checkpoint_every": draw(st.integers(0, 1000)), "predicted_iteration_s": draw(st.integers(0, 10**6)),
        "spares": ids[d * s:],
        "holdings": [Holding(r, draw(st.binary(min_size=32, max_size=32)).hex(),
                             tuple(draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True))))
                     for r in zip([0, *cuts], [*cuts, n_layer])] if draw(st.booleans()) else [],
        "absent": [draw(st.binary(min_size=32, max_size=32).filter(lambda b: b not in ids))]
                  if draw(st.booleans()) else [],
        "reason": draw(st.text(max_size=40)),
        "last_op_ms": draw(st.sampled_from([0, 1, 2**53]) | st.integers(0, 2**53)),
        "council": draw(st.binary(max_size=64)),
    }


@settings(max_examples=60, deadline=None)
@given(allocation_fields())
def test_encoding_is_canonical(fields):
    a = Allocation(**fields)
    # The same allocation built another way: tuples for lists, floats for ints, a fresh config.
    b = Allocation(**{**fields, "pipelines": tuple(map(tuple, fields["pipelines"])),
                      "layer_ranges": tuple(fields["layer_ranges"]), "spares": tuple(fields["spares"]),
                      "predicted_iteration_s": float(fields["predicted_iteration_s"]),
                      "train": TrainConfig.from_dict(fields["train"].to_dict())})
    assert a == b
    assert a.encode() == b.encode()
    decoded = Allocation.decode(a.encode())
    assert decoded == a and decoded.encode() == a.encode()


BODY_FIELDS = ("version", "run_id", "term", "epoch", "issuer", "preset", "model", "train", "pipelines",
               "layer_ranges", "spares", "data_hash", "data_name", "start_step", "end_step", "checkpoint_every",
               "predicted_iteration_s", "holdings", "absent", "reason", "voters", "operator_start",
               "compression", "compress_links", "last_op_ms", "council")
# (per_link: told by the links; dp_ramp_syncs, dp_overlap_steps: travel only where they are not the default)
EXACT_MAP = {k: v for k, v in CompressionConfig().to_dict().items()
             if k not in ("per_link", "dp_ramp_syncs", "dp_overlap_steps")}


def reads_only_6(version: int) -> str:
    return rf"allocation format {version}, this peer reads 6: run the same dtfm version"


def test_body_is_a_fixed_list_with_sorted_config_maps():
    a = make(spares=1, holdings=[Holding(r, "ab" * 32, (IDS[0],)) for r in even_ranges(TINY.n_layer, 2)],
             absent=[bytes([99]) * 32], reason="train start", voters=sorted(IDS[:3]), operator_start=b"op",
             last_op_ms=OP_MS, council=b"a council")
    body = body_list(a)  # one format for every run: 26 fields, in this order
    assert FORMAT_VERSION == 6 and FORMATS == (6,) and len(body) == len(BODY_FIELDS) == 26
    assert dict(zip(BODY_FIELDS, body)) == {
        "version": 6, "run_id": RUN, "term": 1, "epoch": 3, "issuer": ISSUER.peer_id, "preset": "tiny",
        "model": TINY.to_dict(), "train": {k: v for k, v in CFG.to_dict().items() if k not in ("precision", "pipeline_warmups")},  # (fp32, GPipe: no field)
        "pipelines": [IDS[0:2], IDS[2:4]],
        "layer_ranges": [[0, 2], [2, 4]], "spares": [IDS[4]], "data_hash": DATA_HASH, "data_name": "corpus.txt",
        "start_step": 5, "end_step": 100, "checkpoint_every": 10, "predicted_iteration_s": 1.25,
        "holdings": [h.to_wire() for h in a.holdings], "absent": [bytes([99]) * 32], "reason": "train start",
        "voters": sorted(IDS[:3]), "operator_start": b"op", "compression": EXACT_MAP, "compress_links": None,
        "last_op_ms": OP_MS, "council": b"a council",
    }
    model, train, compression = body[6], body[7], body[22]
    assert list(model) == sorted(model) and list(train) == sorted(train) and list(compression) == sorted(compression)
    assert GPTSpec.from_dict(model) == TINY and TrainConfig.from_dict(train) == CFG
    assert type(body[16]) is float  # float64 on the wire, whatever the allocation was built with
    assert Allocation.decode(a.encode()) == a


DILOCO8 = parse_compression("diloco,inner_steps=8")


def test_a_compressed_run_and_an_exact_one_both_travel_in_format_6_with_their_compression():
    exact = make()
    ex = body_list(exact)
    assert ex[0] == 6 and len(ex) == 26 and ex[22] == EXACT_MAP and ex[23] is None  # an exact run names it too
    assert CompressionConfig.from_dict(ex[22]) == CompressionConfig()
    assert make(compression=CompressionConfig()).encode() == exact.encode()
    a = make(compression=DILOCO8, spares=1)
    body = body_list(a)
    # the same format and fields as the exact run: only the compression map differs
    assert body[0] == 6 and len(body) == 26 and body[23] is None and body[24:] == [0, b""]
    same_exact = body_list(dataclasses.replace(a, compression=CompressionConfig()))
    assert same_exact[22] == EXACT_MAP and body[:22] + body[23:] == same_exact[:22] + same_exact[23:]
    assert body[22] != ex[22] and list(body[22]) == sorted(body[22]) and "per_link" not in body[22]
    assert CompressionConfig.from_dict(body[22]) == DILOCO8
    assert Allocation.decode(exact.encode()).compression == CompressionConfig()
    signed = SignedAllocation.sign(a, ISSUER)
    assert signed.open() == a and signed.open().compression == DILOCO8
    # the compression is signed: changed after signing, the signature fails
    forged = SignedAllocation(_with(body, 22, {**body[22], "inner_steps": 16}), signed.signature)
    assert Allocation.decode(forged.body).compression.inner_steps == 16
    with pytest.raises(ProtocolError, match="bad signature"):
        forged.open()
    # so is an exact run's: made compressed after signing, the signature fails
    signed_exact = SignedAllocation.sign(exact, ISSUER)
    forged = SignedAllocation(_with(ex, 22, body[22]), signed_exact.signature)
    assert Allocation.decode(forged.body).compression == DILOCO8
    with pytest.raises(ProtocolError, match="bad signature"):
        forged.open()


COMPRESSED = body_list(make(compression=DILOCO8))
COMPRESSION_FIELD = [
    # (what, body, words of the ProtocolError)
    ("an int for a float (one allocation, one body)", _with(COMPRESSED, 22, {**COMPRESSED[22], "outer_lr": 1}),
     "canonical"),
    ("an exact run without its compression map", _with(COMPRESSED, 22, None), "compression: expected a map"),
    ("the compression field left out", pack(COMPRESSED[:22] + COMPRESSED[23:]), "format 6 has 26 fields, got 25"),
    ("an unknown method", _with(COMPRESSED, 22, {**COMPRESSED[22], "dp_method": "zip"}), "dp_method"),
    ("an unknown field", _with(COMPRESSED, 22, {**COMPRESSED[22], "dp_magic": 1}), "unknown fields"),
    ("per_link in the map (the links tell it)", _with(COMPRESSED, 22, {**COMPRESSED[22], "per_link": True}),
     "unknown fields"),
    ("a missing field", _with(COMPRESSED, 22, {k: v for k, v in COMPRESSED[22].items() if k != "inner_steps"}),
     "inner_steps"),
    ("a mistyped field", _with(COMPRESSED, 22, {**COMPRESSED[22], "inner_steps": 8.0}), "inner_steps"),
    ("an out-of-range field", _with(COMPRESSED, 22, {**COMPRESSED[22], "outer_momentum": 1.5}), "outer_momentum"),
    ("not a map", _with(COMPRESSED, 22, "diloco"), "compression: expected a map"),
    ("an unknown format", _with(COMPRESSED, 0, 7), reads_only_6(7)),
]


@pytest.mark.parametrize("what, body, words", COMPRESSION_FIELD, ids=[c[0] for c in COMPRESSION_FIELD])
def test_a_bad_compression_field_is_refused(what, body, words):
    with pytest.raises(ProtocolError, match=words):
        Allocation.decode(body)


AUTO = parse_compression("auto")
# 3 stages x 2 pipelines: links 0->1 of pipeline 0 and 1->2 of pipeline 1 compress, the DP group of stage 2
LINKS = LinkCodecs(((True, False), (False, True)), (False, False, True))
LINKS_WIRE = [[[True, False], [False, True]], [False, False, True]]


def test_a_per_link_run_travels_in_format_6_and_its_choice_is_signed():
    a = make(2, 3, compression=AUTO, compress_links=LINKS)
    body = body_list(a)
    assert body[0] == 6 and len(body) == 26 and body[23] == LINKS_WIRE and body[24:] == [0, b""]
    # the compression map is a uniform run's (per_link is told by the links being there, not nil)
    uniform = body_list(make(2, 3, compression=dataclasses.replace(AUTO, per_link=False)))
    assert uniform[23] is None and body[:23] == uniform[:23] and body[24:] == uniform[24:]
    assert "per_link" not in body[22]
    signed = SignedAllocation.sign(a, ISSUER)
    b = signed.open()
    assert b == a and b.compress_links == LINKS and b.compression == AUTO and b.compression.per_link
    assert b.plan().links == LINKS and b.plan().link_compressed(0, 0) and not b.plan().link_compressed(0, 1)
    forged = SignedAllocation(_with(body, 23, [[[True, True], [False, True]], [False, False, True]]), signed.signature)
    assert Allocation.decode(forged.body).compress_links.pp[0] == (True, True)
    with pytest.raises(ProtocolError, match="bad signature"):
        forged.open()
    # the choice dropped after signing (a uniform run): the signature fails too
    dropped = SignedAllocation(_with(body, 23, None), signed.signature)
    assert not Allocation.decode(dropped.body).compression.per_link
    with pytest.raises(ProtocolError, match="bad signature"):
        dropped.open()
    # golden: the bytes of this body do not change unnoticed
    assert hashlib.sha256(a.encode()).hexdigest()[:16] == GOLDEN_V6


GOLDEN_V6 = "2552fd6acd8d1d20"  # sha256 of the body, first 16 hex digits (auto: DiLoCo at 2 bits dense, 8 ramp syncs)


def test_per_link_compression_and_links_go_together():
    with pytest.raises(ValueError, match="compress_links"):
        make(2, 3, compression=AUTO)
    with pytest.raises(ValueError, match="per-link"):
        make(2, 3, compression=DILOCO8, compress_links=LINKS)
    with pytest.raises(ValueError, match="3 stages x 2 pipelines"):
        make(2, 3, compression=AUTO, compress_links=LinkCodecs(((True,), (True,)), (True, True, True)))
    with pytest.raises(ValueError, match="per_link needs"):
        parse_compression("exact,per_link=true")


PER_LINK = body_list(make(2, 3, compression=AUTO, compress_links=LINKS))
LINKS_FIELD = [
    # (what, the compress_links field, words of the ProtocolError)
    ("not a pair", [[[True, False], [False, True]]], "compress_links must be"),
    ("a row too few", [[[True, False]], [False, False, True]], "2 rows of links and 3 groups"),
    ("a group too many (a stage that does not exist)", [[[True, False], [False, True]], [False] * 4], "3 groups"),
    ("a link too many (a pipeline that does not exist)", [[[True, False, True], [False, True]], [False] * 3],
     "must list 2 links"),
    ("a number for a boolean", [[[1, 0], [0, 1]], [False, False, True]], "link"),
    ("a name for a boolean", [[[True, False], [False, True]], [False, False, "int4"]], "group"),
    ("a huge row", [[[True] * 5000, [False, True]], [False] * 3], "links"),
    ("a map", {"pp": [], "dp": []}, "compress_links"),
    ("false for none", False, "compress_links"),
]


@pytest.mark.parametrize("what, value, words", LINKS_FIELD, ids=[c[0] for c in LINKS_FIELD])
def test_a_bad_links_field_is_refused(what, value, words):
    assert Allocation.decode(pack(PER_LINK)).compress_links == LINKS  # (the body it breaks is valid)
    with pytest.raises(ProtocolError, match=words):
        Allocation.decode(_with(PER_LINK, 23, value))


def test_links_in_an_exact_run_are_refused():
    exact = body_list(make(2, 3))
    assert exact[22] == EXACT_MAP and exact[23] is None
    with pytest.raises(ProtocolError, match="compress_links in an exact run"):
        Allocation.decode(_with(exact, 23, LINKS_WIRE))


@pytest.mark.parametrize("kw", [{}, {"compression": DILOCO8}, {"compression": AUTO, "compress_links": LINKS}],
                         ids=["exact", "compressed", "per-link"])
def test_the_last_resume_or_reschedule_travels_signed_in_format_6_and_none_is_0(kw):
    old = make(2, 3, **kw)
    a = dataclasses.replace(old, last_op_ms=OP_MS)
    body, old_body = body_list(a), body_list(old)
    assert old.last_op_ms == 0 and old_body[0] == 6 and len(old_body) == 26 and old_body[24] == 0  # none: 0
    assert body[0] == 6 and len(body) == 26 and body[24] == OP_MS
    assert body[:24] == old_body[:24] and body[25] == old_body[25] == b""  # only the time differs
    assert body[23] == (LINKS_WIRE if "compress_links" in kw else None)  # the links, nil when not per-link
    assert CompressionConfig.from_dict(body[22]) == dataclasses.replace(a.compression, per_link=False)
    assert Allocation.decode(old.encode()).last_op_ms == 0
    signed = SignedAllocation.sign(a, ISSUER)
    assert signed.open() == a and signed.open().last_op_ms == OP_MS
    # the time is signed: moved back after signing (to let an older stop in), the signature fails
    forged = SignedAllocation(_with(body, 24, OP_MS - 60_000), signed.signature)
    assert Allocation.decode(forged.body).last_op_ms == OP_MS - 60_000
    with pytest.raises(ProtocolError, match="bad signature"):
        forged.open()
    # ... and so does one cleared to none
    cleared = SignedAllocation(_with(body, 24, 0), signed.signature)
    assert Allocation.decode(cleared.body) == old
    with pytest.raises(ProtocolError, match="bad signature"):
        cleared.open()
    latest = dataclasses.replace(old, last_op_ms=2**53)  # the largest time an operation can carry
    assert Allocation.decode(latest.encode()).last_op_ms == 2**53


WITH_OP = body_list(dataclasses.replace(make(2, 3), last_op_ms=OP_MS))
OP_FIELD = [
    # (what, body, words of the ProtocolError)
    ("a negative time", _with(WITH_OP, 24, -1), r"'last_op_ms': -1 outside"),
    ("a time past 2^53 ms", _with(WITH_OP, 24, 2**53 + 1), r"'last_op_ms': 9007199254740993 outside"),
    ("a float", _with(WITH_OP, 24, float(OP_MS)), r"'last_op_ms': expected an int"),
    ("a string", _with(WITH_OP, 24, str(OP_MS)), r"'last_op_ms': expected an int"),
    ("nil for none", _with(WITH_OP, 24, None), r"'last_op_ms': expected an int"),
    ("the time left out", pack(WITH_OP[:24] + WITH_OP[25:]), "format 6 has 26 fields, got 25"),
    ("a field too many", pack([*WITH_OP, 0]), "format 6 has 26 fields, got 27"),
    ("links in an exact run", _with(WITH_OP, 23, LINKS_WIRE), "exact run"),
]


@pytest.mark.parametrize("what, body, words", OP_FIELD, ids=[c[0] for c in OP_FIELD])
def test_a_bad_operation_time_is_refused(what, body, words):
    assert Allocation.decode(pack(WITH_OP)).last_op_ms == OP_MS  # (the body it breaks is valid)
    with pytest.raises(ProtocolError, match=words):
        Allocation.decode(body)


# Bodies as formats 3 (no compression), 4 (its compression), 5 (a per-link run's links) wrote them.
_EXACT, _PER_LINK = body_list(make(2, 3)), PER_LINK
OLD_FORMATS = [
    (3, [3, *_EXACT[1:22]]),
    (4, [4, *COMPRESSED[1:23]]),
    (5, [5, *_PER_LINK[1:24]]),
    (3, [3, *_EXACT[1:]]),  # the old numbers on today's fields: still not read
    (4, [4, *COMPRESSED[1:]]),
    (5, [5, *_PER_LINK[1:]]),
]


@pytest.mark.parametrize("version, body", OLD_FORMATS,
                         ids=[f"format {v}, {len(b)} fields" for v, b in OLD_FORMATS])
def test_the_old_formats_are_no_longer_read(version, body):
    with pytest.raises(ProtocolError, match=reads_only_6(version)):
        Allocation.decode(pack(body))
    with pytest.raises(ProtocolError, match=reads_only_6(version)):
        SignedAllocation(pack(body), b"\x00" * 64).open()


def test_the_council_travels_signed_as_bytes_within_its_bound():
    assert MAX_COUNCIL_BYTES == COUNCIL_BYTES  # the allocation bounds it as council.py does
    for council in (b"", b"\x00", bytes(range(256)) * 3, b"\xab" * MAX_COUNCIL_BYTES):
        a = make(2, 3, council=council)
        body = body_list(a)
        assert body[0] == 6 and len(body) == 26 and body[25] == council and type(body[25]) is bytes
        b = Allocation.decode(a.encode())
        assert b == a and b.council == council
    a = make(2, 3, compression=AUTO, compress_links=LINKS, last_op_ms=OP_MS, council=b"the council")
    assert body_list(a)[22:] == [body_list(a)[22], LINKS_WIRE, OP_MS, b"the council"]
    signed = SignedAllocation.sign(a, ISSUER)
    assert signed.open().council == b"the council"
    # the council is signed: swapped after signing, the signature fails
    forged = SignedAllocation(_with(body_list(a), 25, b"another council"), signed.signature)
    assert Allocation.decode(forged.body).council == b"another council"
    with pytest.raises(ProtocolError, match="bad signature"):
        forged.open()


def test_a_council_too_large_is_refused():
    with pytest.raises(ValueError, match=f"council must be at most {MAX_COUNCIL_BYTES} bytes"):
        make(council=b"\x00" * (MAX_COUNCIL_BYTES + 1))
    body = body_list(make())
    too_large = rf"'council': {MAX_COUNCIL_BYTES + 1} bytes, expected 0\.\.{MAX_COUNCIL_BYTES}"
    with pytest.raises(ProtocolError, match=too_large):
        Allocation.decode(_with(body, 25, b"\x00" * (MAX_COUNCIL_BYTES + 1)))


@pytest.mark.parametrize("value", ["a council", 7, None, [b"a"], {"root": b"a"}, bytearray(b"abc")],
                         ids=["str", "int", "nil", "list", "map", "bytearray"])
def test_a_council_not_bytes_is_refused(value):
    with pytest.raises(ValueError, match="council must be"):
        make(council=value)
    if isinstance(value, bytearray):
        return  # (msgpack writes it as bytes)
    with pytest.raises(ProtocolError, match="'council': expected bytes"):
        Allocation.decode(_with(body_list(make()), 25, value))


def test_the_council_field_left_out_is_refused():
    body = body_list(make(council=b"c"))
    with pytest.raises(ProtocolError, match="format 6 has 26 fields, got 25"):
        Allocation.decode(pack(body[:25]))


@settings(max_examples=100, deadline=None)
@given(st.integers(22, len(WITH_OP) - 1), wire_values)
def test_a_format_6_field_replaced_by_garbage_raises_only_protocol_error(index, value):
    decodes_only_canonically(_with(WITH_OP, index, value))


def test_dp_compression_with_a_tied_head_across_stages_is_refused():
    tied = dataclasses.replace(TINY, tied_head=True)
    with pytest.raises(ValueError, match="tied head"):
        make(model=tied, compression=DILOCO8)
    make(model=tied, compression=parse_compression("pp-int8"))  # the pipeline axis alone is fine
    make(d=2, s=1, model=tied, compression=DILOCO8)  # one stage: one copy


def test_only_the_canonical_encoding_is_accepted():
    body = body_list(make())
    unsorted = dict(reversed(list(body[6].items())))  # the same model, keys out of order
    with pytest.raises(ProtocolError, match="canonical"):
        Allocation.decode(_with(body, 6, unsorted))
    with pytest.raises(ProtocolError, match="canonical"):
        Allocation.decode(_with(body, 16, 2))  # predicted_iteration_s as an int, not a float64
    train = dict(body[7], lr=3)  # an int where the config holds a float
    with pytest.raises(ProtocolError, match="canonical"):
        Allocation.decode(_with(body, 7, train))


@pytest.mark.parametrize("index, value, match", [
    (0, 2, reads_only_6(2)),
    (0, 3, reads_only_6(3)),
    (0, 4, reads_only_6(4)),
    (0, 5, reads_only_6(5)),
    (0, 7, reads_only_6(7)),
    (0, -1, "'version'"),
    (2, -1, "'term'"),
    (3, 0, "'epoch'"),
    (4, b"short", "'issuer'"),
    (1, b"x" * 15, "'run_id'"),
    (6, {**TINY.to_dict(), "dropout": 0.1}, "unknown fields"),
    (6, {k: v for k, v in TINY.to_dict().items() if k != "n_head"}, "missing field 'n_head'"),
    (6, {**TINY.to_dict(), "n_head": 3}, "not divisible"),
    (6, {**TINY.to_dict(), "n_layer": "4"}, "expected an int"),
    (7, {**CFG.to_dict(), "wire_dtype": "int8"}, "wire_dtype"),
    (7, {**CFG.to_dict(), "lr": True}, "expected a number"),
    (8, [IDS[:2], IDS[1:3]], "only one stage"),
    (8, [IDS[:2], IDS[2:3]], "every pipeline"),
    (8, [], "at least one pipeline"),
    (9, [[0, 2], [3, 4]], "contiguous"),
    (9, [[0, 2], [2, 5]], "the model has 4"),
    (9, [[0, 2, 4]], "layer range"),
    (10, [IDS[0]], "spare also holds"),
    (10, [IDS[5], IDS[5]], "listed twice"),
    (11, "ab" * 31, "data_hash"),
    (11, DATA_HASH.upper(), "data_hash"),
    (13, 100, "must come before"),
    (16, float("1e10"), "predicted_iteration_s"),
])
def test_malformed_fields_are_refused(index, value, match):
    with pytest.raises(ProtocolError, match=match):
        Allocation.decode(_with(body_list(make()), index, value))


def test_a_batch_too_small_for_the_pipelines_is_refused():
    train = dataclasses.replace(TEST_CONFIG, micro_batches=4)  # 8 sequences, 4 pipelines x 4 micro-batches
    with pytest.raises(ValueError, match="too small"):
        make(d=4, s=2, train=train)
    body = body_list(make(d=4, s=2, train=dataclasses.replace(train, micro_batches=2)))
    with pytest.raises(ProtocolError, match="too small"):
        Allocation.decode(_with(body, 7, {**body[7], "micro_batches": 4}))


def test_the_largest_allocation_fits_its_bound():
    ids = [i.to_bytes(32, "big") for i in range(1, 4097)]
    model = dataclasses.replace(TINY, n_layer=1024)
    a = make(pipelines=[ids[k * 1024:(k + 1) * 1024] for k in range(4)], layer_ranges=even_ranges(1024, 1024),
             model=model)
    assert len(a.encode()) <= MAX_ALLOCATION_BYTES
    assert Allocation.decode(a.encode()) == a
    with pytest.raises(ValueError, match="more than 4096"):
        dataclasses.replace(a, spares=[(5000).to_bytes(32, "big")])
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        Allocation.decode(b"\x00" * (MAX_ALLOCATION_BYTES + 1))


def test_body_changed_after_signing_is_refused():
    signed = SignedAllocation.sign(make(), ISSUER)
    body = body_list(make())
    for index, value in [(3, 4), (8, [IDS[1::-1], IDS[2:4]]), (12, "other.txt")]:
        forged = SignedAllocation(_with(body, index, value), signed.signature)
        Allocation.decode(forged.body)  # well formed, so only the signature stops it
        with pytest.raises(ProtocolError, match="bad signature"):
            forged.open()


def test_allocation_signed_by_another_key_is_refused():
    body = make().encode()
    with pytest.raises(ProtocolError, match="bad signature"):
        SignedAllocation(body, MALLORY.sign(ALLOCATION_DOMAIN + body)).open()
    with pytest.raises(ProtocolError, match="bad signature"):  # the issuer's key, without the domain tag
        SignedAllocation(body, ISSUER.sign(body)).open()
    with pytest.raises(ValueError, match="cannot be signed"):
        SignedAllocation.sign(make(), MALLORY)


def test_issuer_swapped_is_refused():
    signed = SignedAllocation.sign(make(), ISSUER)
    swapped = _with(body_list(make()), 4, MALLORY.peer_id)
    with pytest.raises(ProtocolError, match="bad signature"):
        SignedAllocation(swapped, signed.signature).open()
    # Mallory re-signs under her own name: a valid allocation, but issued by Mallory, not the coordinator.
    resigned = SignedAllocation(swapped, MALLORY.sign(ALLOCATION_DOMAIN + swapped)).open()
    assert resigned.issuer == MALLORY.peer_id


@settings(max_examples=200, deadline=None)
@given(wire_values)
def test_garbage_objects_raise_only_protocol_error(obj):
    with pytest.raises(ProtocolError):
        Allocation.decode(pack(obj))
    for from_wire in (SignedAllocation.from_wire, Refusal.from_wire):
        try:
            from_wire(obj)
        except ProtocolError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(min_size=64, max_size=64))
def test_random_bytes_raise_only_protocol_error(data, signature):
    with pytest.raises(ProtocolError):
        SignedAllocation(data, signature).open()


def decodes_only_canonically(body: bytes) -> None:
    """`body` (a field replaced by garbage) is refused with ProtocolError, or it was a
    well-formed, canonical replacement: it decodes to an allocation that encodes to it again."""
    try:
        a = Allocation.decode(body)
    except ProtocolError:
        return
    assert a.encode() == body


VALID_BODY = body_list(make(spares=1))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(VALID_BODY) - 1), wire_values)
def test_one_field_replaced_by_garbage_raises_only_protocol_error(index, value):
    body = _with(VALID_BODY, index, value)
    decodes_only_canonically(body)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(COMPRESSED) - 1),
       wire_values | st.dictionaries(st.sampled_from(sorted(COMPRESSED[22])), wire_values))
def test_a_compressed_run_field_replaced_by_garbage_raises_only_protocol_error(index, value):
    merged = index == 22 and isinstance(value, dict)
    decodes_only_canonically(_with(COMPRESSED, index, {**COMPRESSED[22], **value} if merged else value))


@settings(max_examples=100, deadline=None)
@given(st.integers(22, len(PER_LINK) - 1), wire_values)
def test_a_per_link_run_field_replaced_by_garbage_raises_only_protocol_error(index, value):
    decodes_only_canonically(_with(PER_LINK, index, value))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_truncated_or_flipped_bodies_raise_only_protocol_error(data):
    body = make(spares=1).encode()
    cut = data.draw(st.integers(0, len(body) - 1))
    with pytest.raises(ProtocolError):
        Allocation.decode(body[:cut])
    i, bit = data.draw(st.integers(0, len(body) - 1)), data.draw(st.integers(0, 7))
    flipped = bytearray(body)
    flipped[i] ^= 1 << bit
    try:
        Allocation.decode(bytes(flipped))
    except ProtocolError:
        pass


# ---------------------------------------------------------------------- agreement with Plan


def _outcome(build):
    try:
        return build()
    except ValueError:
        return None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from(IDS[:6]), max_size=4), max_size=4),
       st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=4), st.integers(0, 5))
def test_allocation_and_plan_agree_on_what_is_valid(pipelines, ranges, epoch):
    n_layer = ranges[-1][1] if ranges and ranges[-1][1] >= 1 else 4
    model = dataclasses.replace(TINY, n_layer=n_layer)
    train = dataclasses.replace(TEST_CONFIG, global_batch_seqs=64, micro_batches=1)
    plan = _outcome(lambda: Plan(pipelines, ranges, epoch))
    alloc = _outcome(lambda: make(pipelines=pipelines, layer_ranges=ranges, model=model, train=train,
                                  epoch=max(epoch, 1)))
    assert (plan is None) == (alloc is None)
    if alloc is not None:
        assert alloc.plan() == Plan(pipelines, ranges, alloc.epoch)
        assert alloc.plan().stages == alloc.stages and alloc.plan().dp == alloc.dp
        assert all(alloc.plan().position(p) == alloc.position(p) for p in alloc.peers)


# ---------------------------------------------------------------------- acceptance


def ctx(alloc: Allocation, **kw) -> AcceptContext:
    """The context of a peer (IDS[1]) that agrees with `alloc` on everything."""
    live = frozenset(alloc.peers) | frozenset(alloc.spares)
    fields = {"me": IDS[1], "live": live, "known_presets": PRESETS, "data_hash": alloc.data_hash,
              "data_name": "corpus.txt", "applied": None, "run_id": None}
    fields.update(kw)
    return AcceptContext(**fields)


A = make(spares=1)  # IDS[0..3] hold stages, IDS[4] is a spare
STRANGER = IDS[9]

ACCEPTANCE = [
    # (case, allocation, context overrides, expected code)
    ("accepted", A, {}, None),
    ("accepted as a spare", A, {"me": IDS[4]}, None),
    ("accepted, newer epoch", A, {"applied": (1, 2), "run_id": RUN}, None),
    ("accepted, newer term", A, {"applied": (0, 9), "run_id": RUN}, None),
    ("accepted, other run", A, {"applied": (5, 9), "run_id": b"\x00" * 16}, None),
    ("stale, same", A, {"applied": (1, 3), "run_id": RUN}, "stale"),
    ("stale, older epoch", A, {"applied": (1, 4), "run_id": RUN}, "stale"),
    ("stale, older term", A, {"applied": (2, 1), "run_id": RUN}, "stale"),
    ("not a member", A, {"me": STRANGER, "live": frozenset(A.peers) | {IDS[4]}}, "not-member"),
    ("unknown preset", dataclasses.replace(A, preset="huge"), {}, "unknown-preset"),
    ("preset differs", dataclasses.replace(A, model=dataclasses.replace(TINY, n_embd=64)), {}, "preset-mismatch"),
    ("data differs", A, {"data_hash": OTHER_HASH, "data_name": "mine.txt"}, "data-mismatch"),
    ("dead peer", A, {"live": frozenset(IDS[:3]), "known": frozenset(IDS[:5])}, "dead-peer"),
    ("unknown peer", A, {"live": frozenset(IDS[:3]) | {IDS[4]}}, "unknown-peer"),
    ("live peer left out", A, {"live": frozenset(IDS[:6])}, "not-covered"),
]


@pytest.mark.parametrize("case, alloc, overrides, code", ACCEPTANCE, ids=[c[0] for c in ACCEPTANCE])
def test_check_allocation(case, alloc, overrides, code):
    refusal = check_allocation(alloc, ctx(alloc, **overrides))
    assert (refusal and refusal.code) == code
    if refusal is not None:
        assert refusal.reason and Refusal.from_wire(unpack_untrusted(pack(refusal.to_wire()), max_len=4096)) == refusal


def test_every_refusal_code_has_a_case():
    assert {c[3] for c in ACCEPTANCE} - {None} == set(REFUSAL_CODES)


def test_refusal_reasons_tell_the_operator_what_to_do():
    data = check_allocation(A, ctx(A, data_hash=OTHER_HASH, data_name="mine.txt"))
    assert "'corpus.txt'" in data.reason and "'mine.txt'" in data.reason
    assert DATA_HASH[:12] in data.reason and OTHER_HASH[:12] in data.reason and "--data FILE" in data.reason
    dead = check_allocation(A, ctx(A, live=frozenset(IDS[:3]), known=frozenset(IDS[:5])))
    assert short_id(IDS[3]) in dead.reason and short_id(IDS[4]) in dead.reason and short_id(IDS[2]) not in dead.reason
    many = frozenset(IDS[:5]) | {bytes([0xa0 + i]) * 32 for i in range(20)}
    left_out = check_allocation(A, ctx(A, live=many))
    assert "and 12 more" in left_out.reason  # 20 named, 8 shown
    mismatch = check_allocation(dataclasses.replace(A, model=dataclasses.replace(TINY, n_embd=64)), ctx(A))
    assert "n_embd" in mismatch.reason and "128" in mismatch.reason and "64" in mismatch.reason


def test_refusal_codes_are_checked():
    with pytest.raises(ValueError):
        Refusal("Not A Code", "x")
    with pytest.raises(ProtocolError, match="bad code"):
        Refusal.from_wire({"code": "drop table", "reason": ""})


# ---------------------------------------------------------------------- neighbours vs a real run


class RecordingComm(InMemoryComm):
    def isend(self, peer, tag, tensor):
        with self.hub.lock:
            self.hub.pairs.add((self.me, peer))
        return super().isend(peer, tag, tensor)


class RecordingHub(InMemoryHub):
    """An in-memory hub that records who sends to whom."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.pairs: set[tuple[bytes, bytes]] = set()

    def endpoint(self, me):
        return RecordingComm(self, me)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=256 << 10)


@pytest.mark.parametrize("d, s, tied, compress", [(2, 2, False, "exact"), (4, 2, False, "exact"),
                                                  (2, 4, False, "exact"), (2, 3, True, "exact"),
                                                  (4, 2, False, "cocktail"), (3, 2, False, "pp-int4"),
                                                  (4, 2, False, "cocktail,per_link=true")])
def test_neighbours_are_exactly_who_a_step_talks_to(corpus, d, s, tied, compress):
    model = dataclasses.replace(TINY, tied_head=tied)
    per_link = parse_compression(compress).per_link  # (stage 0's group exact: its ring neighbours only)
    links = LinkCodecs(((True, False, False, True),), (False, True)) if per_link else None
    a = make(d, s, spares=1, model=model, compression=parse_compression(compress), compress_links=links,
             train=dataclasses.replace(CFG, global_batch_seqs=12) if d == 3 else CFG)
    hub = RecordingHub()
    with LocalCluster(a.model, a.train, a.plan(), corpus, compression=a.compression) as cluster:
        cluster.hub = hub
        cluster.step()
    for peer in a.peers:
        talked = {dst for src, dst in hub.pairs if src == peer} | {src for src, dst in hub.pairs if dst == peer}
        assert a.neighbours(peer) == talked, a.position(peer)
    assert a.neighbours(a.spares[0]) == frozenset()


def test_holdings_must_cover_the_model_in_order_and_travel_signed():
    a = make()
    h = [Holding(r, "ab" * 32, (IDS[0],)) for r in a.layer_ranges]
    b = dataclasses.replace(a, holdings=h, absent=[bytes([99]) * 32], reason="peer 1234 is dead")
    signed = SignedAllocation.sign(b, ISSUER)
    assert signed.open() == b and signed.open().holdings[0].holders == (IDS[0],)
    with pytest.raises(ValueError, match="contiguous"):
        dataclasses.replace(a, holdings=list(reversed(h)))
    with pytest.raises(ValueError, match="cover"):
        dataclasses.replace(a, holdings=h[:-1])
    with pytest.raises(ValueError, match="absent peer"):
        dataclasses.replace(a, absent=[a.peers[0]])
    with pytest.raises(ValueError, match="digest"):
        Holding((0, 1), "xyz", (IDS[0],))
    with pytest.raises(ValueError, match="holders"):
        Holding((0, 1), "ab" * 32, ())


def test_the_warm_start_travels_only_where_a_compression_has_one():
    from dtfm.control.allocation.fields import config_from_wire, config_to_wire
    from dtfm.train.compress import get_compression
    assert "dp_ramp_syncs" not in config_to_wire(CompressionConfig(), "compression")
    diloco = get_compression("diloco")
    wire = config_to_wire(diloco, "compression")
    assert wire["dp_ramp_syncs"] == diloco.dp_ramp_syncs > 0
    assert config_from_wire(CompressionConfig, wire, "compression") == dataclasses.replace(diloco, per_link=False)
    older = {k: v for k, v in wire.items() if k != "dp_ramp_syncs"}  # an allocation from before the field
    assert config_from_wire(CompressionConfig, older, "compression").dp_ramp_syncs == 0


def test_a_pipeline_schedule_travels_signed_and_must_name_each_stage():
    """The scheduler's warm-up counts (1F1B) travel in the allocation's training config; an
    allocation whose counts do not name its stages is refused where it is read."""
    fitted = dataclasses.replace(CFG, pipeline_warmups="2,0")
    a = make(train=fitted)
    assert body_list(a)[BODY_FIELDS.index("train")]["pipeline_warmups"] == "2,0"
    back = Allocation.decode(a.encode())
    assert back.train.warmups(back.stages) == (2, 0)
    with pytest.raises(ValueError, match="names 3 stages, the pipeline has 2"):
        make(train=dataclasses.replace(CFG, pipeline_warmups="2,1,0"))
