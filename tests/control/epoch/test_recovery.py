"""Weight recovery: digests, fetching a stage from several holders over loopback transports,
holders that lie, hang or vanish, hostile requests, and re-layouts that train like one process."""

from __future__ import annotations

import dataclasses
import socket
from contextlib import asynccontextmanager

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.control.epoch.recovery import (
    Part,
    RecoveryError,
    RecoveryServer,
    fetch_stage,
    manifest_digest,
    parse_chunk_request,
    parse_manifest_request,
)
from dtfm.control.epoch.relayout import assemble_stage, needed_stages
from dtfm.control.export import max_weights_bytes
from dtfm.control.epoch.runner import params_sha256
from dtfm.control.messages import ControlMsg
from dtfm.control.refusals import Refused
from dtfm.net import ConnectionClosed, Identity, ProtocolError, Transport, TransportConfig, short_id
from dtfm.train import (
    TEST_CONFIG,
    LocalCluster,
    Plan,
    StageState,
    TransferError,
    TransferReceiver,
    encode_transfer,
    get_preset,
    load_corpus,
    parse_compression,
    reference_state,
    reference_step,
    save_checkpoint,
)

KEY = bytes(range(32))
RUN = bytes(range(16))
SPEC = get_preset("tiny")
CFG = TEST_CONFIG
CHUNK = 64 << 10  # many chunks from a tiny stage
LAYERS = (0, 2)
STEP = 5
LIMIT = 64 << 20


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=256 << 10)


def make_state(layer_range=LAYERS, step=STEP, nudge: float = 0.0, compression=None) -> StageState:
    """A stage as a holder would have it at `step`, with non-zero moments (and compression
    buffers); `nudge` changes one weight."""
    st = StageState(SPEC, CFG, layer_range, compression=compression)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in st.params:
            st.optim.exp_avg[n].copy_(torch.randn(st.params[n].shape, generator=gen) * 1e-3)
            st.optim.exp_avg_sq[n].copy_(torch.rand(st.params[n].shape, generator=gen) * 1e-6)
        for buf in st.compress.buffers.values():
            buf.copy_(torch.randn(buf.shape, generator=gen))
        next(iter(st.params.values())).view(-1)[0] += nudge
    st.step, st.optim.step_count = step, step
    return st


def digest_of(state: StageState, chunk_bytes: int = CHUNK) -> str:
    return manifest_digest(encode_transfer(state, chunk_bytes)[0])


def moments_equal(a: StageState, b: StageState) -> bool:
    sa, sb = a.optim.state_tensors(), b.optim.state_tensors()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@dataclasses.dataclass
class Node:
    transport: Transport
    server: RecoveryServer
    addr: tuple[str, int] = ("", 0)

    @property
    def id(self) -> bytes:
        return self.transport.peer_id

    @property
    def source(self) -> tuple[bytes, tuple[str, int]]:
        return self.id, self.addr


def anyone(peer: bytes, key) -> None:
    """A recovery server's rule that lets every authenticated peer fetch (the fetch mechanics)."""
    return None


@asynccontextmanager
async def swarm(n: int, server_cls=RecoveryServer):
    """`n` transports listening on loopback, each with its recovery server."""
    nodes = []
    for _ in range(n):
        t = Transport(Identity.generate(), KEY, TransportConfig.test())
        nodes.append(Node(t, server_cls(t, chunk_bytes=CHUNK, authorize=anyone)))
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.addr = await nursery.start(node.transport.serve, "127.0.0.1", 0)
        try:
            yield nodes
        finally:
            with trio.move_on_after(5):
                for node in nodes:
                    await node.transport.aclose()
            nursery.cancel_scope.cancel()


async def fetch(me: Node, holders, digest: str, **kw):
    args = {"run_id": RUN, "step": STEP, "layer_range": LAYERS, "digest": digest, "max_total_bytes": LIMIT,
            "timeout_s": 5.0, **kw}
    with trio.fail_after(30):
        return await fetch_stage(me.transport, [h if isinstance(h, tuple) else h.source for h in holders], **args)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- digests


def test_equal_stages_have_equal_digests_and_any_change_shows():
    d = digest_of(make_state())
    assert d == digest_of(make_state())
    assert len(d) == 64
    assert d != digest_of(make_state(nudge=1e-3))
    assert d != digest_of(make_state(step=STEP + 1))
    assert d != digest_of(make_state(), chunk_bytes=CHUNK // 2)  # the chunk size is part of it


def test_data_parallel_replicas_have_equal_digests(corpus):
    with LocalCluster(SPEC, CFG, Plan.grid(SPEC.n_layer, 2, 2), corpus) as cl:
        cl.run(1)
        for s in range(2):
            a, b = (cl.states[p] for p in cl.plan.dp_group(s))
            assert digest_of(a) == digest_of(b)


# ----------------------------------------------------------------------------- fetching


async def test_fetch_spreads_over_holders_and_arrives_bit_identical():
    state = make_state()
    async with swarm(4) as (me, *holders):
        offers = [await h.server.offer(RUN, state) for h in holders]
        assert len({o.digest for o in offers}) == 1
        result = await fetch(me, holders, offers[0].digest)
        got = result.receiver.finish(SPEC, CFG, LAYERS)
        assert params_sha256(got) == params_sha256(state) and moments_equal(got, state)
        assert (got.step, got.optim.step_count) == (STEP, STEP)
        n = len(offers[0].chunks)
        assert n > 50 and sum(result.per_source.values()) == n and result.failed == {}
        assert len(result.per_source) == 3  # round-robin over every holder
        assert result.bytes == offers[0].manifest.total_bytes
        served = [h.server.offers()[0] for h in holders]
        assert sum(s["served_bytes"] for s in served) == result.bytes
        assert served[0]["digest"] == offers[0].digest and served[0]["layers"] == list(LAYERS)


class CorruptServer(RecoveryServer):
    """Serves every chunk with one byte flipped."""

    async def offer(self, run_id, state):
        offer = await super().offer(run_id, state)
        offer.chunks = [bytes([c[0] ^ 1]) + c[1:] for c in offer.chunks]
        return offer


async def test_holder_serving_corrupt_chunks_is_dropped(caplog):
    state = make_state()
    async with swarm(3) as (me, good1, good2), swarm(1, CorruptServer) as (bad,):
        digest = (await bad.server.offer(RUN, state)).digest
        for h in (good1, good2):
            await h.server.offer(RUN, state)
        result = await fetch(me, [bad, good1, good2], digest)  # the liar even gives the manifest
    assert "fails its hash" in result.failed[bad.id]
    assert bad.id not in result.per_source and set(result.per_source) == {good1.id, good2.id}
    assert params_sha256(result.receiver.finish(SPEC, CFG, LAYERS)) == params_sha256(state)
    assert any(short_id(bad.id) in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("other_first", [True, False])
async def test_holder_with_another_digest_is_not_used(other_first):
    state = make_state()
    async with swarm(4) as (me, other, good1, good2):
        await other.server.offer(RUN, make_state(nudge=1e-3))
        digest = (await good1.server.offer(RUN, state)).digest
        await good2.server.offer(RUN, state)
        order = [other, good1, good2] if other_first else [good1, other, good2]
        result = await fetch(me, order, digest)
        assert other.id in result.failed and other.id not in result.per_source
        assert other.server.offers()[0]["served_bytes"] == 0
        assert params_sha256(result.receiver.finish(SPEC, CFG, LAYERS)) == params_sha256(state)


class HangingServer(RecoveryServer):
    async def _on_chunk(self, conn, msg_type, body, payload):
        await trio.sleep_forever()


async def test_holder_that_stops_answering_is_dropped_after_the_timeout():
    state = make_state()
    async with swarm(2) as (me, good), swarm(1, HangingServer) as (slow,):
        digest = (await slow.server.offer(RUN, state)).digest
        await good.server.offer(RUN, state)
        result = await fetch(me, [slow, good], digest, timeout_s=0.5)
    assert result.failed == {slow.id: "timed out"}
    assert result.per_source == {good.id: len(result.receiver.manifest.chunk_sha256)}


async def test_every_holder_gone_raises_naming_each():
    state = make_state()
    gone, unknown = Identity.generate().peer_id, Identity.generate().peer_id
    async with swarm(3) as (me, other, empty):
        await other.server.offer(RUN, make_state(nudge=1e-3))
        digest = digest_of(state)
        holders = [(gone, ("127.0.0.1", closed_port())), (unknown, None), other, empty]
        with pytest.raises(RecoveryError) as e:
            await fetch(me, holders, digest)
    msg = str(e.value)
    assert f"layers [0, 2] at step {STEP}" in msg
    for p in (gone, unknown, other.id, empty.id):
        assert short_id(p) in msg
    assert "not held here" in msg and "holds digest" in msg


async def test_a_peer_the_holders_allocations_do_not_name_is_refused():
    # Holder `named` serves only the peers its rule lets fetch (in the daemon, those its
    # allocations name, control/epoch/access.py): `me` is named, `outsider` is not.
    state = make_state()
    async with swarm(3) as (me, outsider, named):
        allowed = {me.id}
        named.server.authorize = lambda peer, key: None if peer in allowed and key[0] == RUN \
            else Refused.FETCH_NOT_NAMED
        digest = (await named.server.offer(RUN, state)).digest
        with pytest.raises(RecoveryError) as e:
            await fetch(outsider, [named], digest)
        assert "only the peers an allocation names fetch its stages" in str(e.value)
        conn = await outsider.transport.connect(*named.addr, peer_id=named.id)  # a chunk straight away
        reply, payload = await conn.request(ControlMsg.FETCH_CHUNK, {"run": RUN, "step": STEP, "layers": list(LAYERS),
                                                                     "digest": digest, "index": 0}, timeout_s=5)
        assert set(reply) == {"error"} and payload is None
        assert named.server.served_bytes == 0 and named.server.refusals.counts() == {"fetch-not-named": 2}
        result = await fetch(me, [named], digest)
        assert result.bytes == named.server.served_bytes > 0


class WithdrawingServer(RecoveryServer):
    """Withdraws the run as soon as it has handed out a manifest."""

    async def _on_manifest(self, conn, msg_type, body, payload):
        reply = await super()._on_manifest(conn, msg_type, body, payload)
        self.withdraw(RUN)
        return reply


async def test_connect_override_and_self_skipped():
    state = make_state()
    async with swarm(3) as (me, h1, h2):
        digest = (await h1.server.offer(RUN, state)).digest
        await h2.server.offer(RUN, state)
        dialled = []

        async def connect(peer, addr):
            dialled.append(peer)
            node = {h1.id: h1, h2.id: h2}[peer]
            return await me.transport.connect(*node.addr, peer_id=peer)

        await me.server.offer(RUN, state)  # holding it itself, it never asks itself
        result = await fetch(me, [(me.id, me.addr), (h1.id, None), (h2.id, None)], digest, connect=connect)
        assert sorted(dialled) == sorted([h1.id, h2.id]) and set(result.per_source) == {h1.id, h2.id}


async def test_stage_lost_mid_fetch_raises():
    """The only holder withdraws after the manifest: its refusal ends the fetch with a RecoveryError."""
    async with swarm(1) as (me,), swarm(1, WithdrawingServer) as (holder,):
        digest = (await holder.server.offer(RUN, make_state())).digest
        with pytest.raises(RecoveryError, match=f"{short_id(holder.id)}: refused"):
            await fetch(me, [holder], digest)


async def test_manifest_over_the_size_limit_is_refused():
    state = make_state()
    async with swarm(2) as (me, holder):
        offer = await holder.server.offer(RUN, state)
        with pytest.raises(RecoveryError, match="stage size"):
            await fetch(me, [holder], offer.digest, max_total_bytes=offer.manifest.total_bytes - 1)
        result = await fetch(me, [holder], offer.digest, max_total_bytes=offer.manifest.total_bytes)
        assert result.receiver.complete


async def test_checkpoint_offers_withdraw_and_eviction(tmp_path):
    state = make_state()
    path = save_checkpoint(tmp_path, state)
    async with swarm(2) as (me, holder):
        server = holder.server
        offer = await server.offer_checkpoint(RUN, path)
        assert offer.digest == digest_of(state) and (offer.step, offer.layer_range) == (STEP, LAYERS)
        assert (await fetch(me, [holder], offer.digest)).receiver.complete
        assert server.withdraw(RUN) == 1 and server.offers() == []
        with pytest.raises(RecoveryError, match="not held"):
            await fetch(me, [holder], offer.digest)
        server.max_offers = 2
        for step in range(3):
            await server.offer(RUN, make_state(layer_range=(2, 4), step=step))
        assert [o["step"] for o in server.offers()] == [1, 2]  # the oldest went
        other = bytes(16)
        await server.offer(other, make_state(step=7))
        assert [o["step"] for o in server.offers()] == [2, 7]
        assert server.withdraw(None, Part.STAGE, keep={(RUN, 2, (2, 4))}) == 1  # every run's, but the kept
        assert [o["step"] for o in server.offers()] == [2]
        assert server.withdraw(other) == 0 and server.withdraw(RUN, Part.WEIGHTS) == 0


# ----------------------------------------------------------------------------- weights offers (export)


async def test_a_weights_offer_holds_the_parameters_alone_under_its_own_digest():
    """A holder offers a DiLoCo stage (moments, residuals, anchor, outer momentum) for recovery
    and its weights for an export that names `exporter`: the weights offer is the parameters'
    bytes and a header, under a digest that names neither the stage's content nor is named by
    it. Only `exporter` fetches the weights, only as weights; a recovery fetch never gets them,
    an export fetch never gets the stage, and the weights never become a stage to train on."""
    state = make_state(compression=parse_compression("diloco,inner_steps=4"))
    async with swarm(3) as (exporter, outsider, holder):
        stage = await holder.server.offer(RUN, state)
        weights = await holder.server.offer_weights(RUN, state, frozenset({exporter.id}))
        param_bytes = 4 * sum(p.numel() for p in state.params.values())
        assert 0 < weights.manifest.total_bytes - param_bytes < 128 * len(state.params)
        assert stage.manifest.total_bytes > 5 * weights.manifest.total_bytes  # (2 moments, 3 DiLoCo buffers)
        assert weights.digest != stage.digest
        assert manifest_digest(stage.manifest) != weights.digest and manifest_digest(weights.manifest) != stage.digest
        assert [o["part"] for o in holder.server.offers()] == ["stage", "weights"]

        result = await fetch(exporter, [holder], weights.digest, part=Part.WEIGHTS)
        assert result.bytes == weights.manifest.total_bytes == holder.server.served_bytes
        got = result.receiver.tensors()
        assert sorted(got) == sorted(f"param/{n}" for n in state.params)
        assert all(torch.equal(got[f"param/{n}"], p.detach()) for n, p in state.params.items())
        with pytest.raises(TransferError, match="not a whole stage"):
            result.receiver.finish(SPEC, CFG, LAYERS, compression=state.compress.config)

        with pytest.raises(RecoveryError, match="holds digest"):  # the stage's digest: not the weights offer
            await fetch(exporter, [holder], stage.digest, part=Part.WEIGHTS)
        with pytest.raises(RecoveryError, match="holds digest"):  # the weights' digest: not the stage offer
            await fetch(exporter, [holder], weights.digest)
        conn = await exporter.transport.connect(*holder.addr, peer_id=holder.id)
        key = {"run": RUN, "step": STEP, "layers": list(LAYERS)}
        for body in (dict(key, digest=weights.digest, index=0), dict(key, part="weights", digest=stage.digest, index=0)):
            reply, payload = await conn.request(ControlMsg.FETCH_CHUNK, body, timeout_s=5)
            assert "not held" in reply["error"] and payload is None
        with pytest.raises(RecoveryError, match="only the peer an operator's signed export names"):
            await fetch(outsider, [holder], weights.digest, part=Part.WEIGHTS)
        assert holder.server.refusals.counts() == {"export-not-signed": 1}
        assert (await fetch(outsider, [holder], stage.digest)).bytes == stage.manifest.total_bytes  # (its rule: anyone)

        await holder.server.offer_weights(RUN, state, frozenset({outsider.id}))  # a second export, the same weights
        assert (await fetch(outsider, [holder], weights.digest, part=Part.WEIGHTS)).receiver.complete
        assert (await fetch(exporter, [holder], weights.digest, part=Part.WEIGHTS)).receiver.complete
        # an epoch that starts lets go of the stage offers alone (StageHost.start): the export's stays
        assert holder.server.withdraw(RUN, Part.STAGE) == 1
        assert [o["part"] for o in holder.server.offers()] == ["weights"]
        assert (await fetch(exporter, [holder], weights.digest, part=Part.WEIGHTS)).receiver.complete
        assert holder.server.withdraw(RUN) == 1 and holder.server.offers() == []


class WholeStageServer(RecoveryServer):
    """Offers the whole stage where its weights are asked for (a holder that lies)."""

    async def offer_weights(self, run_id, state, fetchers):
        offer = await self.offer(run_id, state)
        return self._keep(dataclasses.replace(offer, part=Part.WEIGHTS, fetchers=fetchers))


async def test_a_whole_stage_offered_as_weights_is_refused_by_the_fetcher():
    """The digest a fetcher is given is the holders' word; the manifest must also be a weights
    manifest, and within the size the plan's model allows."""
    state = make_state()
    async with swarm(1) as (exporter,), swarm(1, WholeStageServer) as (holder,):
        offer = await holder.server.offer_weights(RUN, state, frozenset({exporter.id}))
        with pytest.raises(RecoveryError, match="offers a whole stage where its weights alone were asked for"):
            await fetch(exporter, [holder], offer.digest, part=Part.WEIGHTS)
        with pytest.raises(RecoveryError, match="stage size"):
            await fetch(exporter, [holder], offer.digest, part=Part.WEIGHTS,
                        max_total_bytes=max_weights_bytes(SPEC, LAYERS))
        assert holder.server.served_bytes == 0


def test_a_weights_manifest_is_bounded_by_the_plans_model():
    """`max_weights_bytes`, what an export lets a holder's weights manifest claim, holds every
    stage's weights, tied or not, with biases or not, and is not three times too large."""
    tied = dataclasses.replace(SPEC, tied_head=True, bias=True, n_layer=5)
    for spec, r in ((SPEC, (0, 4)), (SPEC, (1, 3)), (tied, (0, 1)), (tied, (3, 5))):
        size = encode_transfer(StageState(spec, CFG, r), weights_only=True)[0].total_bytes
        assert size <= max_weights_bytes(spec, r) < 1.1 * size, (spec, r)


# ----------------------------------------------------------------------------- hostile requests

GOOD = {"run": RUN, "step": 3, "layers": [0, 2]}
GOOD_CHUNK = dict(GOOD, digest="ab" * 32, index=0)


@pytest.mark.parametrize("body", [
    None, [], b"x", {}, dict(GOOD, extra=1), {"run": RUN, "step": 3}, dict(GOOD, part="stage"),
    dict(GOOD, part="Weights"), dict(GOOD, part=None), dict(GOOD, part=b"weights"), dict(GOOD, part="weights", extra=1),
    dict(GOOD, run=RUN[:15]), dict(GOOD, run="x" * 16), dict(GOOD, step=-1), dict(GOOD, step=True),
    dict(GOOD, step=1.0), dict(GOOD, step=2**63), dict(GOOD, layers=[0]), dict(GOOD, layers=[2, 2]),
    dict(GOOD, layers=[-1, 2]), dict(GOOD, layers=[0, "2"]), dict(GOOD, layers=[0, 1, 2]),
    dict(GOOD, layers=(0, 2.0)), dict(GOOD, layers={"a": 0}),
])
def test_malformed_manifest_requests_raise_protocol_error(body):
    with pytest.raises(ProtocolError):
        parse_manifest_request(body)
    with pytest.raises(ProtocolError):
        parse_chunk_request(dict(body, digest="ab" * 32, index=0) if isinstance(body, dict) else body)


@pytest.mark.parametrize("change", [
    {"digest": "AB" * 32}, {"digest": "ab" * 31}, {"digest": b"ab" * 32}, {"digest": "zz" * 32},
    {"index": -1}, {"index": "0"}, {"index": 2**40}, {"index": None},
])
def test_malformed_chunk_requests_raise_protocol_error(change):
    with pytest.raises(ProtocolError):
        parse_chunk_request(dict(GOOD_CHUNK, **change))
    assert parse_manifest_request(GOOD) == ((RUN, 3, (0, 2)), Part.STAGE)
    assert parse_chunk_request(GOOD_CHUNK) == ((RUN, 3, (0, 2)), Part.STAGE, "ab" * 32, 0)
    assert parse_manifest_request(dict(GOOD, part="weights")) == ((RUN, 3, (0, 2)), Part.WEIGHTS)
    assert parse_chunk_request(dict(GOOD_CHUNK, part="weights")) == ((RUN, 3, (0, 2)), Part.WEIGHTS, "ab" * 32, 0)


_WIRE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) | st.text(max_size=70)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(sorted(GOOD_CHUNK) + ["part"])
                                                                 | st.text(max_size=5),
                                                                 inner, max_size=6),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_WIRE)
def test_garbage_bodies_raise_only_protocol_error(body):
    for parse in (parse_manifest_request, parse_chunk_request):
        try:
            parse(body)
        except ProtocolError:
            pass


@pytest.mark.parametrize("msg_type, body", [
    (ControlMsg.FETCH_MANIFEST, dict(GOOD, step="3")),
    (ControlMsg.FETCH_CHUNK, dict(GOOD_CHUNK, digest="no")),
    (ControlMsg.FETCH_CHUNK, "index-out-of-range"),
])
async def test_malformed_request_closes_the_connection(msg_type, body):
    state = make_state()
    async with swarm(2) as (me, holder):
        offer = await holder.server.offer(RUN, state)
        conn = await me.transport.connect(*holder.addr, peer_id=holder.id)
        key = {"run": RUN, "step": STEP, "layers": list(LAYERS)}
        reply, _ = await conn.request(ControlMsg.FETCH_MANIFEST, dict(key, step=STEP + 1), timeout_s=5)
        assert "not held" in reply["error"] and not conn.closed  # a fair question, a fair answer
        if body == "index-out-of-range":
            body = dict(key, digest=offer.digest, index=len(offer.chunks))
        with pytest.raises(ConnectionClosed):
            await conn.request(msg_type, body, timeout_s=5)
        assert conn.closed and holder.server.served_bytes == 0


# ----------------------------------------------------------------------------- re-layout


async def test_new_stage_from_old_stages_fetched_over_the_network():
    """Old layout (0, 2), (2, 4), each held by two peers; the new stage (1, 3) fetches both
    (needed_stages) by their digests and assembles its blocks from them."""
    old_ranges = [(0, 2), (2, 4)]
    olds = [make_state(r) for r in old_ranges]
    async with swarm(5) as (me, *holders):
        digests = []
        for i, state in enumerate(olds):
            for h in holders[2 * i:2 * i + 2]:
                digests.append((await h.server.offer(RUN, state)).digest)
        parts = []
        for i in needed_stages(old_ranges, (1, 3)):
            result = await fetch(me, holders[2 * i:2 * i + 2], digests[2 * i], layer_range=old_ranges[i])
            assert len(result.per_source) == 2
            parts.append(result.receiver)
    new = assemble_stage(SPEC, CFG, (1, 3), parts, STEP, STEP)
    have = {**olds[0].params, **olds[1].params}
    assert sorted(new.params) == sorted(n for n in have if n.startswith(("h.1.", "h.2.")))
    for n, p in new.params.items():
        assert torch.equal(p, have[n])
        assert torch.equal(new.optim.exp_avg_sq[n], {**olds[0].optim.exp_avg_sq, **olds[1].optim.exp_avg_sq}[n])


async def test_a_compressed_stage_moves_with_its_compression_state():
    """A DiLoCo run's stages (residual, anchor, outer momentum) fetched over the network and
    re-laid out from (0, 2), (2, 4) into (1, 3): every compression buffer follows its parameter,
    bit for bit; a part trained with another compression, or the run's own without it, is refused."""
    comp = parse_compression("diloco,inner_steps=4")
    old_ranges = [(0, 2), (2, 4)]
    olds = [make_state(r, compression=comp) for r in old_ranges]
    async with swarm(3) as (me, *holders):
        digests = [(await h.server.offer(RUN, state)).digest for h, state in zip(holders, olds)]
        parts = [(await fetch(me, [holders[i]], digests[i], layer_range=old_ranges[i])).receiver
                 for i in needed_stages(old_ranges, (1, 3))]
    new = assemble_stage(SPEC, CFG, (1, 3), parts, STEP, STEP, compression=comp)
    have = {**olds[0].compress.state_tensors(), **olds[1].compress.state_tensors()}
    got = new.compress.state_tensors()
    assert sorted(got) == sorted(k for k in have if k.split("/")[-1].startswith(("h.1.", "h.2.")))
    assert {k.split("/")[1] for k in got} == {"ef", "anchor", "outer_m"}
    for k, v in got.items():
        assert torch.equal(v, have[k]), k
    with pytest.raises(RecoveryError, match="compression"):
        assemble_stage(SPEC, CFG, (1, 3), parts, STEP, STEP, compression=parse_compression("cocktail"))
    with pytest.raises(RecoveryError, match="compression"):
        assemble_stage(SPEC, CFG, (1, 3), parts, STEP, STEP)  # an exact run


def test_needed_stages():
    old = [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert needed_stages(old, (0, 2)) == [0, 1]
    assert needed_stages(old, (2, 4)) == [2, 3]
    assert needed_stages(old, (0, 4)) == [0, 1, 2, 3]
    assert needed_stages(old, (1, 3)) == [1, 2]
    assert needed_stages([(0, 2), (2, 4)], (1, 2)) == [0]
    assert needed_stages([(0, 2), (2, 4)], (0, 1)) == [0]
    assert needed_stages([(0, 4)], (2, 3)) == [0]


def receiver_of(state: StageState) -> TransferReceiver:
    manifest, chunks = encode_transfer(state, CHUNK)
    rx = TransferReceiver(manifest)
    for i, c in enumerate(chunks):
        rx.feed(i, c)
    return rx


def test_assemble_refuses_missing_tensors_and_other_steps():
    parts = [receiver_of(make_state((0, 2))), receiver_of(make_state((2, 4)))]
    with pytest.raises(RecoveryError, match="h.1"):
        assemble_stage(SPEC, CFG, (1, 3), parts[1:], STEP, STEP)
    with pytest.raises(RecoveryError, match="ln_f"):
        assemble_stage(SPEC, CFG, (2, 4), [{k: v for k, v in parts[1].tensors().items() if "ln_f" not in k}],
                       STEP, STEP)
    with pytest.raises(RecoveryError, match="step"):
        assemble_stage(SPEC, CFG, (1, 3), parts, STEP + 1, STEP + 1)
    whole = assemble_stage(SPEC, CFG, (0, 4), parts, STEP, STEP)
    assert whole.step == STEP and whole.optim.step_count == STEP


_REF: dict = {}


def reference(spec, corpus, steps: int) -> tuple[list[float], StageState]:
    if spec not in _REF:
        state = reference_state(spec, CFG)
        _REF[spec] = [reference_step(state, corpus) for _ in range(steps)], state
    return _REF[spec]


def unchanged_layout(spec, corpus) -> dict[str, torch.Tensor]:
    """Parameters after 4 steps of the 4-stage layout, never re-laid-out."""
    key = ("unchanged", spec)
    if key not in _REF:
        with LocalCluster(spec, CFG, Plan.grid(spec.n_layer, 4, 1), corpus) as cl:
            cl.run(4)
            _REF[key] = {n: p.detach() for st in cl.states.values() for n, p in st.params.items()}
    return _REF[key]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("new_stages, weights", [(2, None), (1, None), (3, [1, 2, 1])])
def test_relayout_trains_like_one_process(corpus, tied, new_stages, weights):
    """4 stages train 2 steps; their states are re-assembled into another number of stages,
    which train 2 more: every loss equals single-process training."""
    spec = dataclasses.replace(SPEC, tied_head=tied)
    old_plan = Plan.grid(spec.n_layer, 4, 1, prefix="old")
    with LocalCluster(spec, CFG, old_plan, corpus) as cl:
        losses = cl.run(2)
        olds = [cl.states[p] for p in old_plan.pipeline(0)]
        old = [receiver_of(st) for st in olds]
    if tied:  # the first stage's embedding and the last stage's copy are one tensor, bit for bit
        a, b = olds[0], olds[-1]
        assert torch.equal(a.params["wte.weight"], b.params["wte.weight"])
        assert all(torch.equal(getattr(a.optim, m)["wte.weight"], getattr(b.optim, m)["wte.weight"])
                   for m in ("exp_avg", "exp_avg_sq"))
    new_plan = Plan.grid(spec.n_layer, new_stages, 1, weights=weights, prefix="new")
    assert new_plan.layer_ranges != old_plan.layer_ranges
    states = {}
    for p, rng in zip(new_plan.pipeline(0), new_plan.layer_ranges):
        parts = [old[i] for i in needed_stages(old_plan.layer_ranges, rng)]
        states[p] = assemble_stage(spec, CFG, rng, parts, step=2, optim_step=2)
    with LocalCluster(spec, CFG, new_plan, corpus, states=states) as cl:
        losses += cl.run(2)
    ref_losses, ref = reference(spec, corpus, 4)
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= 1e-5, (losses, ref_losses)
    params = {n: p.detach() for st in states.values() for n, p in st.params.items()}
    assert params.keys() == ref.params.keys()
    names = sorted(params)
    want = torch.cat([ref.params[n].detach().reshape(-1) for n in names])
    got = torch.cat([params[n].reshape(-1) for n in names])
    assert float((got - want).norm()) <= 1e-5 * float(want.norm())
    # Tensor by tensor, micro-batching's rounding against the reference shows (up to 3e-5 relative
    # on attention weights of the tied model); the old layout, never re-laid-out, is the oracle there.
    for n, p in unchanged_layout(spec, corpus).items():
        assert float((params[n] - p).abs().max()) <= 1e-6, n
