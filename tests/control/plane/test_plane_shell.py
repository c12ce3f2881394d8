"""What only the control plane's shell (control/plane.py) does: reading messages off the wire
(signatures, malformed bodies), waiting for a coordinator's first heartbeat, building a stage
(never from re-initialised weights), the applied allocation on disk across a restart, the
checkpoints it lists and offers, and `train start --min-peers`. Driven through `ControlPlane`'s
public methods and the message handlers it registers on the transport, called as a peer's
messages would call them. The machines' decisions are tested in tests/control/epoch/test_epoch_machine.py and
tests/control/coordinator/test_coordinator_machine.py; the protocol is in docs/control.md."""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
import trio.testing

from dtfm.control import (
    Allocation,
    Certificate,
    ControlMsg,
    ControlPlane,
    PeerRunState,
    PlaneConfig,
    SignedAllocation,
    SignedOp,
    TrainError,
    TrainRequest,
    manifest_digest,
    KNOBS,
    council_arg,
    root_council,
    sign_op,
)
from dtfm.control.allocation import Holding
from dtfm.control.election import PreviousConfiguration, config_digest, vote_payload
from dtfm.control.coordinator.machine import Phase
from dtfm.control.coordinator.steplog import StepLog
from dtfm.control.epoch.runner import REPORTS_NOTE, StepReport
from dtfm.control.epoch.applied import Applied, FileAppliedStore, MemoryAppliedStore
from dtfm.control.export import ExportProgress, export_run
from dtfm.control.progress import RunProgress
from dtfm.control.operator import OPERATOR_DOMAIN
from dtfm.gossip import Member, MemberState, build_view
from dtfm.gossip.records import Entry, Report
from dtfm.control.reach import ReachAnswer, ReachRequest
from dtfm.net import Identity, OperatorKey, ProtocolError, Reply, RequestTimeout, pack
from dtfm.train import PRESETS, TEST_CONFIG, Corpus, StageState, encode_transfer, load_hf, save_checkpoint

IDS = [Identity(bytes([i]) * 32) for i in range(1, 6)]
ISSUER, OTHER = IDS[0], IDS[1]
RUN = b"r" * 16
CFG = dataclasses.replace(TEST_CONFIG, micro_batches=2)
TEXT = b"hello swarm " * 4096
CORPUS = Corpus(np.frombuffer(TEXT, dtype=np.uint8).copy(), "corpus")
OPERATOR = OperatorKey(b"\x07" * 32)
INTRUDER = OperatorKey(b"\x08" * 32)


def start_op(key: OperatorKey = OPERATOR, run: bytes = RUN, steps: int = 10, **args) -> SignedOp:
    """The operator's start of `run`, signed now, on this test's corpus."""
    request = {"preset": "tiny", "steps": steps, "seed": CFG.seed, "checkpoint_every": 0, "placement": "scheduler",
               "data_hash": CORPUS.fingerprint, "data_name": CORPUS.name,
               **{k: getattr(CFG, k) for k in KNOBS}, **args}
    return sign_op(key, "start", now_s=time.time(), run_id=run, args=request)


class FakeGossip:
    """Every peer of `peers` alive; `measure(ids)` has each of `ids` report its links to the others."""

    def __init__(self, peers):
        self._members = [Member(p.peer_id, 0, MemberState.ALIVE, "127.0.0.1", 7000 + k, "r")
                         for k, p in enumerate(peers)]
        self.records = type("Records", (), {"reports": {}})()

    def live_peers(self):
        return sorted(m.peer_id for m in self._members)

    def members(self):
        return list(self._members)

    def on_member_change(self, cb):
        pass

    def view(self):
        return build_view(tuple(self.live_peers()), self.records.reports)

    def measure(self, ids):
        for a in ids:
            self.records.reports[a.peer_id] = Report.create(
                a, 1, 0.0, 1.0, [Entry(b.peer_id, 10.0, 1.0, 5) for b in ids if b is not a])


class FakeTransport:
    """A transport with no network: it keeps the handlers the plane registers."""

    def __init__(self, identity: Identity):
        self.peer_id = identity.peer_id
        self.handlers: dict[int, object] = {}

    def handle(self, msg_type, handler):
        self.handlers[msg_type] = handler

    def on_connect(self, cb):
        pass

    def on_disconnect(self, cb):
        pass

    def connection(self, peer_id):
        return None

    async def connect(self, host, port, *, peer_id=None):
        raise OSError("no network in this test")

    async def request(self, sender: Identity, msg: ControlMsg, body):
        """`sender`'s request `msg` as the plane's handler gets it; its reply."""
        return await self.handlers[msg](Conn(sender.peer_id), int(msg), body, None)


@dataclasses.dataclass
class Conn:
    peer_id: bytes
    short_id: str = "peer"


def config(tmp_path: Path) -> PlaneConfig:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT)
    return PlaneConfig(data_path=str(corpus), heartbeat_wait_s=0.05)


@asynccontextmanager
async def running(tmp_path: Path, me: Identity, gossip: FakeGossip | None = None,
                  transport: FakeTransport | None = None):
    """A running plane (its handlers registered, its election and timers running) and its
    transport. On the real clock: the plane's coordinator timer does not let a MockClock
    advance (see test_an_idle_plane_does_not_spin)."""
    transport = transport or FakeTransport(me)
    plane = ControlPlane(transport, me, gossip or FakeGossip(IDS[:4]), tmp_path, config(tmp_path),
                         operators=[OPERATOR.public_key])
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(plane.run)
            yield plane, transport
            nursery.cancel_scope.cancel()


_ROOTS: dict = {}


def root_of(voters) -> object:
    """The council of `voters` as the operator roots it (one council operation per set of voters)."""
    voters = tuple(sorted(voters))
    if voters not in _ROOTS:
        signed = sign_op(OPERATOR, "council", now_s=1.7e9, run_id=b"c" * 16,
                         args={"council": council_arg(voters), "council_size": 5})
        _ROOTS[voters] = root_council(signed, {OPERATOR.public_key})
    return _ROOTS[voters]


def alloc(**kw) -> Allocation:
    """An allocation of RUN by ISSUER, whose council (by default ISSUER alone) the operator rooted."""
    voters = tuple(sorted(kw.pop("voters", (ISSUER.peer_id,))))
    fields: dict = {
        "epoch": 1, "term": 0, "issuer": ISSUER.peer_id, "run_id": RUN,
        "pipelines": [[IDS[0].peer_id, IDS[1].peer_id], [IDS[2].peer_id, IDS[3].peer_id]],
        "layer_ranges": [(0, 2), (2, 4)], "preset": "tiny", "model": PRESETS["tiny"], "train": CFG,
        "data_hash": CORPUS.fingerprint, "data_name": CORPUS.name, "start_step": 0, "end_step": 10,
        "operator_start": start_op().encode(), "voters": voters, "council": root_of(voters).encode()}
    return Allocation(**(fields | kw))


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_spare_checks_its_allocation_against_its_data_set_and_does_not_keep_it(tmp_path):
    # A spare needs its data set's fingerprint to check an allocation (the run's data must be
    # its own, to take a stage later), not the tokens: it reads them for the check and lets
    # them go. A spare whose data set is not the run's refuses the allocation all the same.
    async with running(tmp_path, ISSUER) as (plane, net):
        plane.election.set_root(root_of((ISSUER.peer_id,)))
        plane.election.campaign()
        assert await plane.election.wait_until_coordinator(10)
        cert = {"cert": plane.election.certificate.to_wire()}
        spare = dict(term=plane.election.term, pipelines=[[IDS[1].peer_id, IDS[2].peer_id]],
                     spares=(ISSUER.peer_id,), absent=(IDS[3].peer_id,))
        other = alloc(**spare, data_hash="0" * 64, data_name="issuer.txt")
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, SignedAllocation.sign(other, ISSUER).to_wire() | cert)
        assert reply["code"] == "data-mismatch"
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, SignedAllocation.sign(alloc(**spare), ISSUER).to_wire()
                                  | cert)
        assert reply == {"accepted": True, "role": "spare"}
        assert "data_bytes" not in plane.status()
        assert await plane.data_identity() == (CORPUS.fingerprint, str(tmp_path / "corpus.txt"))
        assert (await plane.corpus()).fingerprint == CORPUS.fingerprint  # (loaded again where a stage needs it)
        assert plane.status()["data_bytes"] == len(TEXT)


async def test_a_forged_or_garbage_allocation_is_refused_with_the_reason(tmp_path):
    async with running(tmp_path, OTHER) as (plane, net):
        assert "data_bytes" not in plane.status()  # (an idle daemon has not loaded its data set)
        signed = SignedAllocation.sign(alloc(), ISSUER)
        forged = SignedAllocation(signed.body, bytes(64))
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, forged.to_wire())
        assert reply["accepted"] is False and reply["code"] == "bad-allocation" and "signature" in reply["reason"]
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, {"body": b"\x00", "sig": b"x"})
        assert reply["accepted"] is False and reply["code"] == "bad-allocation"
        other = SignedAllocation.sign(alloc(data_hash="0" * 64, data_name="issuer.txt"), ISSUER)
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, other.to_wire())  # the check runs on this corpus
        assert reply["code"] == "data-mismatch" and "--data" in reply["reason"]
        assert plane.status()["state"] == "idle" and plane.run_state().run_id is None
        assert plane.status()["data_bytes"] == len(TEXT)  # loaded for the check, and shown


async def test_start_stop_step_and_run_state_messages_are_checked(tmp_path):
    async with running(tmp_path, OTHER) as (plane, net):
        # no accepted epoch: START is refused, STOP is refused, nothing runs
        assert (await net.request(ISSUER, ControlMsg.START, {"run": RUN, "epoch": 1}))["started"] is False
        assert (await net.request(ISSUER, ControlMsg.STOP, {"run": RUN, "at_step": 3}))["stopped"] is False
        for msg, bad in [(ControlMsg.START, [1, 2]), (ControlMsg.STOP, "stop"),
                         (ControlMsg.STEP, {"epoch": "x", "step": 1}), (ControlMsg.STEP, [1]),
                         (ControlMsg.STEP, {"run": RUN, "epoch": 1, "failed": 5})]:
            with pytest.raises(ProtocolError):
                await net.request(ISSUER, msg, bad)
        # a report of a run this peer did not issue is ignored
        assert await net.request(ISSUER, ControlMsg.STEP, {"run": RUN, "epoch": 1, "step": 0, "loss": 1.0,
                                                            "iteration_s": 1.0, "compute_s": 0.1,
                                                            "pipeline_s": 0.5, "sync_s": 0.1}) is None
        assert "issued" not in plane.status() and not (tmp_path / "train.jsonl").exists()
        # RUN_STATE: a query is answered; offers only to the coordinator; malformed ones close
        state = PeerRunState.from_wire(await net.request(ISSUER, ControlMsg.RUN_STATE, {"op": "query"}))
        assert state.run_id is None and state.layers is None and not state.running
        offer = {"op": "offer", "run": RUN, "step": 1, "layers": [0, 2]}
        reply = await net.request(ISSUER, ControlMsg.RUN_STATE, offer)
        assert reply == {"error": "only the coordinator asks for offers"}
        for bad in ({"op": "nuke"}, {"op": "offer", "run": b"short", "step": 1, "layers": [0, 2]},
                    {"op": "offer", "run": RUN, "step": -1, "layers": [0, 2]},
                    {"op": "offer", "run": RUN, "step": 1, "layers": "all"},
                    {"op": "offer", "run": RUN, "step": 1, "layers": [0, 2], "for": [b"short"]},
                    {"op": "offer", "run": RUN, "step": 1, "layers": [0, 2], "for": b"x" * 32},
                    {**offer, "cert": {"t": 1}}, [1, 2]):
            with pytest.raises(ProtocolError):
                await net.request(ISSUER, ControlMsg.RUN_STATE, bad)
        assert plane.status()["refusals"] == {"offer-not-coordinator": 1, "step-other-run": 1}


async def test_run_state_and_stages_are_answered_only_to_the_peers_of_the_run(tmp_path):
    # ISSUER, the coordinator of its own swarm, is a spare of its epoch [n1 n2]: IDS[3], a live
    # member with no part in the run, may neither read its run state nor fetch from it.
    async with running(tmp_path, ISSUER) as (plane, net):
        plane.election.set_root(root_of((ISSUER.peer_id,)))
        plane.election.campaign()
        assert await plane.election.wait_until_coordinator(10)
        a = alloc(term=plane.election.term, pipelines=[[IDS[1].peer_id, IDS[2].peer_id]], spares=(ISSUER.peer_id,),
                  absent=(IDS[3].peer_id,))
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, SignedAllocation.sign(a, ISSUER).to_wire()
                                  | {"cert": plane.election.certificate.to_wire()})
        assert reply == {"accepted": True, "role": "spare"}
        outsider, peer = IDS[3], IDS[1]
        refused = await net.request(outsider, ControlMsg.RUN_STATE, {"op": "query"})
        assert refused == {"error": "only the coordinator and the peers of the run read its state"}
        assert PeerRunState.from_wire(await net.request(peer, ControlMsg.RUN_STATE, {"op": "query"})).run_id == RUN
        fetch = {"run": RUN, "step": 0, "layers": [0, 2]}
        assert await net.request(outsider, ControlMsg.FETCH_MANIFEST, fetch) == {
            "error": "only the peers an allocation names fetch its stages"}
        assert "not held here" in (await net.request(peer, ControlMsg.FETCH_MANIFEST, fetch))["error"]
        assert plane.status()["refusals"] == {"fetch-not-named": 1, "run-state-outsider": 1}


async def test_an_allocation_without_a_certificate_of_its_issuer_is_refused_at_once(tmp_path):
    # An allocation is applied only with the certificate of its issuer's election beside it:
    # whatever the issuer signs, without one (or with another peer's) nothing is applied.
    async with running(tmp_path, OTHER) as (plane, net):
        body = SignedAllocation.sign(alloc(term=3), ISSUER).to_wire()
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, body)
        assert reply["accepted"] is False and reply["code"] == "bad-certificate"
        me = (IDS[2].peer_id,)
        vote = IDS[2].sign(vote_payload(3, me[0], config_digest(me)))
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION,
                                  body | {"cert": Certificate.of(3, me[0], me, {me[0]: vote}).to_wire()})
        assert reply["accepted"] is False and reply["code"] == "bad-certificate"
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, body | {"cert": {"t": 3}})
        assert reply["accepted"] is False and reply["code"] == "bad-allocation"
        assert plane.epoch.current is None and plane.election.last_applied == (0, 0)


async def test_a_resumed_epoch_without_holders_fails_to_build_and_a_restarted_peer_knows_it(tmp_path):
    # The peer is the coordinator of its own one-voter swarm and applies its own allocation of
    # a run resumed at step 5 that names no holders: building the stage fails (its weights are
    # never re-initialised). The applied (term, epoch) is on disk: the peer restarted knows the
    # run it applied, holds no stage, and says so in its status and run state.
    async with running(tmp_path, ISSUER) as (plane, net):
        plane.election.set_root(root_of((ISSUER.peer_id,)))
        plane.election.campaign()
        assert await plane.election.wait_until_coordinator(10)
        term = plane.election.term
        a = alloc(term=term, start_step=5)
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, SignedAllocation.sign(a, ISSUER).to_wire()
                                  | {"cert": plane.election.certificate.to_wire()})
        assert reply["accepted"] is False and reply["code"] == "build-failed"
        assert "names no holders" in reply["reason"]
        assert plane.election.last_applied == (term, 1) and plane.status()["state"] == "stopped"
        with pytest.raises(ProtocolError):  # a STOP of the run applied here needs a step
            await net.request(OTHER, ControlMsg.STOP, {"run": RUN, "at_step": -1})
    again = ControlPlane(FakeTransport(ISSUER), ISSUER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    assert again.election.last_applied == (term, 1) and again.epoch.current == a
    assert again.status()["state"] == "waiting"
    state = again.run_state()
    assert (state.run_id, state.term, state.epoch, state.layers, state.at) == (RUN, term, 1, None, None)
    (tmp_path / "applied.json").write_text('{"run": "zz"}')
    with pytest.raises(TrainError, match="damaged"):
        ControlPlane(FakeTransport(ISSUER), ISSUER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))


async def test_a_peer_restarted_after_an_operators_stop_still_counts_the_run_as_over(tmp_path):
    # Without the kept stop, a coordinator restarted from applied.json would bring the stopped
    # run back from the checkpoints its peers wrote where it stopped, with no `train resume`.
    async with running(tmp_path, ISSUER) as (plane, net):
        plane.election.set_root(root_of((ISSUER.peer_id,)))
        plane.election.campaign()
        assert await plane.election.wait_until_coordinator(10)
        a = alloc(term=plane.election.term, pipelines=[[ISSUER.peer_id]], layer_ranges=[(0, 4)],
                  absent=tuple(p.peer_id for p in IDS[1:4]))
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, SignedAllocation.sign(a, ISSUER).to_wire()
                                  | {"cert": plane.election.certificate.to_wire()})
        assert reply["accepted"] is True
        stop = sign_op(OPERATOR, "stop", now_s=time.time(), run_id=RUN).to_wire()
        assert (await net.request(ISSUER, ControlMsg.STOP, {"run": RUN, "at_step": 0, "final": True, "op": stop}))[
            "stopped"] is True
        assert plane.epoch.run_over()
    again = ControlPlane(FakeTransport(ISSUER), ISSUER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    assert again.epoch.current == a and again.epoch.over_without_finishing(RUN) and again.epoch.run_over()
    # the stop it took is kept too (operations.json): a copy of it is refused after the restart
    copy = SignedOp.from_wire(stop)
    assert again.epoch.taken.taken(copy, RUN)
    assert "taken already" in again.epoch.op_refusal(copy.open(), copy, time.time(), 300.0)
    for store in (FileAppliedStore(tmp_path), MemoryAppliedStore()):
        store.save_stopped(RUN)
        store.save(dataclasses.replace(a, run_id=b"o" * 16), None)  # another run's new epoch: the stop stands
        assert store.stopped() == RUN
        store.save(dataclasses.replace(a, epoch=2), None)  # a new epoch of the run: resumed
        assert store.stopped() is None
        assert store.load() == Applied(RUN, a.term, 2, dataclasses.replace(a, epoch=2), None)
    (tmp_path / "stopped.json").write_text("{garbage")
    assert FileAppliedStore(tmp_path).stopped() is None


async def test_a_checkpoint_is_listed_and_offered_for_a_rollback(tmp_path, autojump_clock):
    # Checkpoints live in one folder per run: run r's is listed and offered; another run's
    # checkpoint of the same layers is neither (its weights are not this run's).
    plane = ControlPlane(FakeTransport(OTHER), OTHER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    other_run = b"o" * 16
    state = StageState(PRESETS["tiny"], CFG, (0, 2))
    state.step = 4
    save_checkpoint(plane.stages.checkpoint_root(RUN), state)
    state.step = 8
    save_checkpoint(plane.stages.checkpoint_root(other_run), state)
    assert plane.stages.checkpoints(RUN) == ((0, 2, 4),) and plane.stages.checkpoints(other_run) == ((0, 2, 8),)
    assert plane.run_state().checkpoints == ()  # no run applied: none to report
    state.step = 4
    reply = await plane.stages.offer(RUN, 4, (0, 2))
    manifest, _ = encode_transfer(state)
    assert reply["digest"] == manifest_digest(manifest) and reply["bytes"] == manifest.total_bytes
    assert "error" in await plane.stages.offer(RUN, 5, (0, 2))  # no stage, snapshot or checkpoint at 5
    assert "error" in await plane.stages.offer(RUN, 8, (0, 2))  # another run's step 8
    # asked again (a reconfiguration retried): the same offer, not read nor encoded a second time
    held = plane.stages.recovery.offered((RUN, 4, (0, 2)))
    plane.stages.checkpoint_root(RUN).rename(tmp_path / "moved")  # (a second read would fail)
    assert await plane.stages.offer(RUN, 4, (0, 2)) == reply
    assert plane.stages.recovery.offered((RUN, 4, (0, 2))) is held


async def test_a_peer_of_the_run_offers_its_initial_weights_at_step_0_and_keeps_nothing_it_does_not_hold(
        tmp_path, autojump_clock):
    # A peer that restarted holding nothing of the run it applied still holds step 0: the run's
    # initial weights, rebuilt from its seed, as every peer rebuilds them (so every holder's
    # digest is the same, and a fetcher checks it). It has no other step, and no step 0 of a
    # run it never applied. Asked to keep what it holds, it writes nothing: it holds nothing.
    plane = ControlPlane(FakeTransport(OTHER), OTHER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    plane.epoch.restore(RUN, 1, 1, alloc(term=1), ())
    reply = await plane.stages.offer(RUN, 0, (2, 4))
    manifest, _ = encode_transfer(StageState(PRESETS["tiny"], CFG, (2, 4)))
    assert reply["digest"] == manifest_digest(manifest) and reply["bytes"] == manifest.total_bytes
    assert "error" in await plane.stages.offer(RUN, 3, (2, 4))
    assert "is not this peer's" in (await plane.stages.offer(b"o" * 16, 0, (2, 4)))["error"]
    assert await plane.stages.keep(RUN) == {"kept": []}
    assert plane.stages.checkpoints(RUN) == ()


async def test_offers_asked_at_once_encode_the_stage_once(tmp_path, autojump_clock):
    # A coordinator's retry and a newly elected coordinator ask for the same offer while it is
    # being encoded: one encoding (one copy of the stage), and every asker gets its digest.
    plane = ControlPlane(FakeTransport(OTHER), OTHER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    state = StageState(PRESETS["tiny"], CFG, (0, 2))
    state.step = 4
    save_checkpoint(plane.stages.checkpoint_root(RUN), state)
    encoded = []
    real = plane.stages.recovery.offer

    async def counting(run_id, st):
        encoded.append(st.step)
        return await real(run_id, st)

    plane.stages.recovery.offer = counting  # type: ignore[method-assign]
    replies = []

    async def ask():
        replies.append(await plane.stages.offer(RUN, 4, (0, 2)))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(ask)
    assert encoded == [4] and len(replies) == 3 and all(r == replies[0] and "digest" in r for r in replies)


async def test_a_peer_building_a_stage_lets_go_of_the_offers_its_build_does_not_fetch(tmp_path, autojump_clock):
    # A peer offered its stage for an earlier reconfiguration (step 4) and, as a holder named by
    # the new allocation, at the new one's start step (8). Building its stage of the new one, it
    # keeps the offer others fetch now and lets go of the older one (a whole stage's bytes that
    # would sit beside the new stage's); an export's weights offer is not a stage offer: it stays.
    plane = ControlPlane(FakeTransport(OTHER), OTHER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    state = StageState(PRESETS["tiny"], CFG, (0, 2))
    for step in (4, 8):
        state.step = step
        save_checkpoint(plane.stages.checkpoint_root(RUN), state)
        assert "digest" in await plane.stages.offer(RUN, step, (0, 2))
    await plane.stages.recovery.offer_weights(RUN, state, frozenset({ISSUER.peer_id}))
    now = plane.stages.recovery.offered((RUN, 8, (0, 2)))
    assert now is not None and plane.stages.recovery.offered((RUN, 4, (0, 2))) is not None
    held = Holding((0, 2), now.digest, (OTHER.peer_id, IDS[3].peer_id))
    elsewhere = Holding((2, 4), "ab" * 32, (IDS[2].peer_id,))
    a = alloc(epoch=3, start_step=8, holdings=(held, elsewhere))
    assert plane.stages.let_go_of_stale_offers(a) == 1
    assert plane.stages.recovery.offered((RUN, 4, (0, 2))) is None
    assert plane.stages.recovery.offered((RUN, 8, (0, 2))) is now
    assert [(o["part"], o["step"]) for o in plane.stages.recovery.offers()] == [("stage", 8), ("weights", 8)]
    # an allocation that names this peer a holder of nothing: its stage offers all go
    others = Holding((0, 2), now.digest, (IDS[3].peer_id,))
    assert plane.stages.let_go_of_stale_offers(alloc(epoch=4, start_step=8, holdings=(others, elsewhere))) == 1
    assert [o["part"] for o in plane.stages.recovery.offers()] == ["weights"]


def export_op(peer: bytes, run: bytes = RUN, key: OperatorKey = OPERATOR, age_s: float = 0.0) -> dict:
    return sign_op(key, "export", now_s=time.time() - age_s, run_id=run, args={"peer": peer.hex()}).to_wire()


async def test_a_holder_gives_a_run_only_to_the_peer_an_operators_export_names(tmp_path):
    # A live member with no part in the run asks what this peer holds of run r and for an
    # offer of layers 0-2: refused without the operator's export, with one that names another
    # peer, of another run, by a key that is not an operator's, or signed too long ago. With
    # its export, it gets the checkpoints' list and an offer of that stage's weights alone,
    # which it may fetch (as weights: not the whole stage a recovery fetches); another peer
    # still may not.
    state = StageState(PRESETS["tiny"], CFG, (0, 2))
    state.step = 4
    async with running(tmp_path, OTHER) as (plane, net):
        save_checkpoint(plane.stages.checkpoint_root(RUN), state)
        asker, other = IDS[3], IDS[2]
        body = {"op": "export", "run": RUN}
        for signed, words in [(None, "none was given"), (export_op(other.peer_id), "not the peer that asks"),
                              (export_op(asker.peer_id, run=b"o" * 16), "not run 72727272"),
                              (export_op(asker.peer_id, key=INTRUDER), "not an operator of this swarm"),
                              (export_op(asker.peer_id, age_s=1000), "signed 1000 s ago")]:
            answer = await net.request(asker, ControlMsg.RUN_STATE, body | ({"signed": signed} if signed else {}))
            assert words in answer["error"], (words, answer)
        signed = export_op(asker.peer_id)
        assert await net.request(asker, ControlMsg.RUN_STATE, body | {"signed": signed}) == {
            "held": [[0, 2, 4]], "spec": PRESETS["tiny"].to_dict()}  # (no run applied: the checkpoint's model)
        stage = {"run": RUN, "step": 4, "layers": [0, 2]}
        fetch = stage | {"part": "weights"}
        assert "not held" in (await net.request(asker, ControlMsg.FETCH_MANIFEST, fetch))["error"]  # not yet offered
        offer = await net.request(asker, ControlMsg.RUN_STATE, body | {"signed": signed, "step": 4, "layers": [0, 2]})
        weights, _ = encode_transfer(state, weights_only=True)
        assert offer == {"digest": manifest_digest(weights), "bytes": weights.total_bytes}
        assert encode_transfer(state)[0].total_bytes > 2.9 * offer["bytes"]  # (the stage: with AdamW moments)
        assert (await net.request(asker, ControlMsg.FETCH_MANIFEST, fetch))["digest"] == offer["digest"]
        assert await net.request(asker, ControlMsg.FETCH_MANIFEST, stage) == {
            "error": "only the peers an allocation names fetch its stages"}
        for msg, ask in ((ControlMsg.FETCH_MANIFEST, fetch), (ControlMsg.FETCH_CHUNK,
                                                              fetch | {"digest": offer["digest"], "index": 0})):
            assert await net.request(other, msg, ask) == {
                "error": "only the peer an operator's signed export names gathers a run"}
        assert plane.status()["refusals"] == {"export-not-signed": 7, "fetch-not-named": 1}
        with pytest.raises(ProtocolError):
            await net.request(asker, ControlMsg.RUN_STATE, body | {"signed": signed, "step": 4, "layers": [2, 1]})
        with pytest.raises(TrainError, match="names peer"):  # the local socket's op: an export naming this peer
            await plane.operator.export(SignedOp.from_wire(export_op(asker.peer_id)), tmp_path / "out")
        with pytest.raises(TrainError, match="no live peer holds any stage of run 6f6f6f6f"):
            await plane.operator.export(SignedOp.from_wire(export_op(OTHER.peer_id, run=b"o" * 16)), tmp_path / "out")
        assert not (tmp_path / "out").exists()


async def test_an_export_fetches_the_weights_alone_and_writes_them(tmp_path):
    # OTHER holds run r's two stages at step 4 in checkpoints (with AdamW moments); IDS[3],
    # named by the operator's export, gathers the run through OTHER's handlers: it fetches each
    # stage's weights offer, the parameters' bytes and a safetensors header, a third of the
    # stage a recovery moves, and the folder it writes holds those parameters.
    states = [StageState(PRESETS["tiny"], CFG, r) for r in ((0, 2), (2, 4))]
    for st in states:
        st.step = st.optim.step_count = 4
        with torch.no_grad():
            for n, p in st.params.items():
                p.add_(0.01)
                st.optim.exp_avg[n].fill_(1e-3)
    asker = IDS[3]
    async with running(tmp_path, OTHER) as (plane, net):
        for st in states:
            save_checkpoint(plane.stages.checkpoint_root(RUN), st)

        async def ask(peers, body, timeout_s):
            return {p: await net.request(asker, ControlMsg.RUN_STATE, body) for p in peers}

        class Fetcher:  # the exporter's transport: its one connection, to OTHER
            peer_id = asker.peer_id

            def connection(self, peer_id):
                return RelayConn(net, asker) if peer_id == OTHER.peer_id else None

        signed = SignedOp.from_wire(export_op(asker.peer_id))
        progress = ExportProgress("r")
        summary = await export_run(signed, RUN, tmp_path / "model", me=asker.peer_id, peers=[OTHER.peer_id], ask=ask,
                                   stages=plane.stages, transport=Fetcher(), address_of=lambda p: None,
                                   timeout_s=10.0, progress=progress)
    weights = [encode_transfer(st, weights_only=True)[0].total_bytes for st in states]
    param_bytes = [4 * sum(p.numel() for p in st.params.values()) for st in states]
    assert summary["stages"] == [[0, 2], [2, 4]] and progress.stages_done == 2
    assert summary["bytes_fetched"] == sum(weights) == plane.stages.recovery.served_bytes
    assert all(0 < w - b < 128 * len(st.params) for w, b, st in zip(weights, param_bytes, states))  # (headers)
    assert summary["bytes_fetched"] < sum(encode_transfer(st)[0].total_bytes for st in states) / 2.9
    _, params = load_hf(tmp_path / "model")
    for st in states:
        for n, p in st.params.items():
            assert torch.equal(params[n], p.detach()), n


async def test_a_restarted_peer_sends_the_step_reports_its_checkpoints_kept(tmp_path):
    # Every peer that reported a step may die before the coordinator logs it; the weights of the
    # step live on in a checkpoint, and so must its line. The runner saves its reports with each
    # checkpoint; a restarted peer sends those of its newest checkpoint of each stage of the run
    # it applied in its run state (a damaged note is left out, another run's never counted).
    def reports(epoch: int, steps: range, last: bool) -> list[dict]:
        return [StepReport(epoch, s, 1.0 + s if last else None, 0.1, 0.05, 0.03, 0.02).to_wire() for s in steps]

    a = alloc()
    (tmp_path / "applied.json").write_text(json.dumps({"run": RUN.hex(), "term": 0, "epoch": 1,
                                                      "allocation": a.encode().hex()}))
    plane = ControlPlane(FakeTransport(OTHER), OTHER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    root = plane.stages.checkpoint_root(RUN)
    first = StageState(PRESETS["tiny"], CFG, (0, 2))  # this peer's stage in epoch 1, steps 0-3
    for step in (2, 4):
        first.step = step
        save_checkpoint(root, first, notes={REPORTS_NOTE: reports(1, range(step), False)})
    last = StageState(PRESETS["tiny"], CFG, (2, 4))  # and in epoch 2, from step 4
    last.step = 6
    save_checkpoint(root, last, notes={REPORTS_NOTE: reports(1, range(4), False) + reports(2, range(4, 6), True)})
    last.step = 9
    save_checkpoint(plane.stages.checkpoint_root(b"o" * 16), last, notes={REPORTS_NOTE: reports(1, range(9), True)})
    again = ControlPlane(FakeTransport(OTHER), OTHER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    assert [(r.epoch, r.step, r.loss) for r in again.run_state().reports] == [
        (1, 0, None), (1, 1, None), (1, 2, None), (1, 3, None), (2, 4, 5.0), (2, 5, 6.0)]
    last.step = 8
    save_checkpoint(root, last, notes={REPORTS_NOTE: {"not": "a list"}})
    again = ControlPlane(FakeTransport(OTHER), OTHER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    assert [(r.epoch, r.step) for r in again.run_state().reports] == [(1, 0), (1, 1), (1, 2), (1, 3)]


async def test_a_restarted_peer_keeps_the_configuration_before_its_last_change(tmp_path):
    # A configuration change the next coordinator never saw is undone by it (the election's
    # `previous`): applied.json keeps the voters before the change, and a restart reads them.
    a = alloc()
    before = tuple(sorted(k.peer_id for k in IDS))
    (tmp_path / "applied.json").write_text(json.dumps({
        "run": RUN.hex(), "term": 2, "epoch": 1, "allocation": a.encode().hex(),
        "previous": {"voters": [v.hex() for v in before], "term": 2}}))
    plane = ControlPlane(FakeTransport(OTHER), OTHER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))
    assert plane.election.previous == PreviousConfiguration(before, 2)
    (tmp_path / "applied.json").write_text(json.dumps({
        "run": RUN.hex(), "term": 2, "epoch": 1, "allocation": a.encode().hex(), "previous": {"voters": ["zz"]}}))
    with pytest.raises(TrainError, match="damaged previous configuration"):
        ControlPlane(FakeTransport(OTHER), OTHER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path))


async def test_train_start_waits_for_the_minimum_swarm_size(tmp_path, autojump_clock):
    # Four peers are live but only two are measured: `--min-peers 3` waits (and says so in the
    # status) until a third is measured, then goes on to the election (none here: no network);
    # `--min-peers 4` gives up after its wait with the count.
    gossip = FakeGossip(IDS[:4])
    plane = ControlPlane(FakeTransport(ISSUER), ISSUER, gossip, tmp_path, config(tmp_path),
                         operators=[OPERATOR.public_key])
    gossip.measure(IDS[:2])
    outcome: list[str] = []

    council = council_arg(tuple(p.peer_id for p in IDS[:3]))  # (the peers it cannot reach: no election)

    async def start():
        try:
            await plane.operator.start_training(start_op(min_peers=3, wait_s=60, council=council))
        except TrainError as e:
            outcome.append(str(e))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(start)
        await trio.sleep(20.5)
        assert plane.status()["waiting_for_peers"] == {"have": 2, "want": 3, "live": 4} and not outcome
        gossip.measure(IDS[:3])
        with trio.fail_after(1.5 * plane.config.swarm_poll_s):  # its next count
            while "waiting_for_peers" in plane.status():
                await trio.sleep(0.1)
    assert outcome and outcome[0].startswith("no coordinator was elected"), outcome
    start_at = trio.current_time()
    with pytest.raises(TrainError, match="only 3 of the 4 peers"):
        await plane.operator.start_training(start_op(min_peers=4, wait_s=5))
    assert trio.current_time() - start_at == pytest.approx(5)
    assert "waiting_for_peers" not in plane.status()


class AnsweringConn:
    """A peer's connection as the joiner sees it: it answers "who is the coordinator?" with
    `answer`, and takes forwarded operator requests when it is the coordinator."""

    def __init__(self, peer: bytes, answer: dict, coordinator: bool):
        self.peer_id, self.short_id = peer, peer.hex()[:8]
        self.answer, self.coordinator = answer, coordinator
        self.forwarded: list[dict] = []

    async def request(self, msg_type, body, timeout_s=None):
        if msg_type == ControlMsg.COORDINATOR:
            assert body == {}
            return self.answer, None
        assert msg_type == ControlMsg.TRAIN_OP and self.coordinator
        self.forwarded.append(body)
        return {"ok": {"run_id": RUN.hex(), "coordinator": self.peer_id.hex()}}, None


class SwarmTransport(FakeTransport):
    def __init__(self, identity: Identity, conns: dict[bytes, AnsweringConn]):
        super().__init__(identity)
        self.conns = conns

    def connection(self, peer_id):
        return self.conns.get(peer_id)


def certificate(term: int, candidate: Identity, signers, voters) -> Certificate:
    ids = tuple(sorted(v.peer_id for v in voters))
    sigs = {v.peer_id: v.sign(vote_payload(term, candidate.peer_id, config_digest(ids))) for v in signers}
    return Certificate.of(term, candidate.peer_id, ids, sigs)


async def test_train_start_is_forwarded_only_to_a_coordinator_verified_against_the_council(tmp_path, autojump_clock):
    # An idle swarm whose coordinator IDS[0] was elected in term 2 by IDS[0..2], the council the
    # operator rooted. IDS[3] is outside the council, so no heartbeat reaches it. With the council
    # (it applied an allocation of it), its `train start` asks the live peers, checks the
    # certificate they pass on against the council and forwards the operator's signed start to
    # the coordinator at once: no election of its own (it never stands), no 30 s wait. Without a
    # council (a joiner), it cannot check any certificate: it forwards nothing, to nobody, and
    # says where to start the run instead (a self-made certificate would otherwise get it); the
    # peers' claim to have a council is only a hint (anyone can claim one), never a refusal of a
    # start that names its own council.
    joiner = IDS[3]
    council = root_of(tuple(p.peer_id for p in IDS[:3]))
    cert = certificate(2, IDS[0], IDS[:2], IDS[:3])
    answer = {"term": 2, "role": "follower", "recognised": True, "lease": True, "voters": 3, "cert": cert.to_wire()}
    conns = {p.peer_id: AnsweringConn(p.peer_id, answer, p is IDS[0]) for p in IDS[:3]}
    gossip = FakeGossip(IDS[:4])
    signed = start_op()
    bare = ControlPlane(SwarmTransport(joiner, conns), joiner, gossip, tmp_path / "bare", config(tmp_path),
                        operators=[OPERATOR.public_key])
    with pytest.raises(TrainError, match="no council yet, and the operator's start names no council; 3 live peer"):
        # (the peers' claim of a council is a hint, never a reason to forward)
        await bare.operator.start_training(signed)
    assert all(c.forwarded == [] for c in conns.values()) and bare.election.voters == ()
    # (what its peers say is named in its status as heard of, nothing more)
    assert bare.status()["election"]["heard_of"] == IDS[0].peer_id.hex() and bare.election.coordinator is None
    plane = ControlPlane(SwarmTransport(joiner, conns), joiner, gossip, tmp_path, config(tmp_path),
                         operators=[OPERATOR.public_key])
    plane.election.set_root(council)
    t0 = trio.current_time()
    with trio.fail_after(5):
        result = await plane.operator.start_training(signed)
    assert result == {"run_id": RUN.hex(), "coordinator": IDS[0].peer_id.hex()}
    assert conns[IDS[0].peer_id].forwarded == [{"op": "start", "signed": signed.to_wire()}]
    assert trio.current_time() - t0 < 1
    election = plane.status()["election"]
    assert (election["role"], election["coordinator"]) == ("follower", IDS[0].peer_id.hex())
    # the answers pass on a certificate with a forged vote: nobody is trusted, and the operator
    # reads who holds a lease of which coordinator and how many voters answer
    forged = Certificate(3, IDS[1].peer_id, cert.voters, ((0, bytes(64)), (1, bytes(64))))
    bad = {**answer, "term": 3, "cert": forged.to_wire()}
    conns = {p.peer_id: AnsweringConn(p.peer_id, bad, False) for p in IDS[:3]}
    other = ControlPlane(SwarmTransport(joiner, conns), joiner, gossip, tmp_path / "x", config(tmp_path),
                         operators=[OPERATOR.public_key])
    other.election.set_root(council)
    with pytest.raises(TrainError) as e:
        await other.operator.start_training(signed)
    text = str(e.value)
    assert text.startswith("no coordinator was elected within 30 s: 3 of the 3 peers asked answered; ")
    assert f"{IDS[0].peer_id.hex()[:8]} holds a lease of coordinator {IDS[1].peer_id.hex()[:8]} (term 3)" in text
    assert all(c.forwarded == [] for c in conns.values())


class FailingCoordinatorConn(AnsweringConn):
    """The coordinator's connection whose forwarded start fails with `answer`; `meanwhile()`
    runs first (the joiner learns of a new coordinator, say)."""

    def __init__(self, peer: bytes, answer: dict, failure: dict, meanwhile=lambda: None):
        super().__init__(peer, answer, True)
        self.failure, self.meanwhile = failure, meanwhile

    async def request(self, msg_type, body, timeout_s=None):
        if msg_type == ControlMsg.TRAIN_OP:
            self.forwarded.append(body)
            self.meanwhile()
            return self.failure, None
        return await super().request(msg_type, body, timeout_s)


@pytest.mark.parametrize("how", ["term-moved", "said-so", "neither"])
async def test_a_start_its_coordinator_could_not_hand_out_before_an_election_replaced_it_says_so(
        tmp_path, autojump_clock, how):
    # IDS[0], coordinator of term 2, takes IDS[3]'s forwarded start; the start fails (its
    # allocation was refused as of an older term). Where the forwarding peer has meanwhile
    # learnt of term 4's coordinator, or the coordinator itself says it was replaced, the
    # failure is marked `deposed` (no run started: the operator signs the start again); a
    # failure within one term is not.
    joiner = IDS[3]
    council = root_of(tuple(p.peer_id for p in IDS[:3]))
    answer = {"term": 2, "role": "follower", "recognised": True, "lease": True, "voters": 3,
              "cert": certificate(2, IDS[0], IDS[:2], IDS[:3]).to_wire()}
    failure = {"error": "the allocation was refused: term 2 is older than this peer's term 4",
               **({"deposed": True} if how == "said-so" else {})}
    plane = None

    def learn_term_4():
        if how == "term-moved":
            plane.election.learn(certificate(4, IDS[1], IDS[:2], IDS[:3]))

    conns = {p.peer_id: AnsweringConn(p.peer_id, answer, False) for p in IDS[1:3]}
    conns[IDS[0].peer_id] = FailingCoordinatorConn(IDS[0].peer_id, answer, failure, learn_term_4)
    plane = ControlPlane(SwarmTransport(joiner, conns), joiner, FakeGossip(IDS[:4]), tmp_path, config(tmp_path),
                         operators=[OPERATOR.public_key])
    plane.election.set_root(council)
    with trio.fail_after(5), pytest.raises(TrainError, match="the allocation was refused") as e:
        await plane.operator.start_training(start_op())
    assert len(conns[IDS[0].peer_id].forwarded) == 1
    assert e.value.deposed is (how != "neither")
    assert ("replaced in term 4" in str(e.value)) is (how == "term-moved")
    assert plane.election.term == (4 if how == "term-moved" else 2)


class RelayConn:
    """`asker`'s connection to a plane in this test: each request goes to that plane's handler."""

    def __init__(self, to: FakeTransport, asker: Identity):
        self.to, self.asker = to, asker
        self.peer_id, self.short_id = to.peer_id, to.peer_id.hex()[:8]

    closed = False

    async def request(self, msg_type, body, *, payload=None, timeout_s=None):
        reply = await self.to.request(self.asker, msg_type, body)
        return (reply.body, reply.payload) if isinstance(reply, Reply) else (reply, None)


async def test_train_status_streams_the_coordinators_steps_to_any_peer_of_the_run(tmp_path):
    # ISSUER coordinates the run [n1 n2] (a spare itself); its steps are reported by n1 and n2.
    # Each logged line goes to train.jsonl (the newest run's) and to train-RUN.jsonl, which no
    # later run overwrites; every line names the run. Asked for the steps after the last one a
    # reader saw, it answers with those, the state, shape, tokens/s and ETA, to the peers of the
    # run only; n1, which never heard of the coordinator, finds it (checked against its council)
    # and relays its answer.
    async with running(tmp_path, ISSUER) as (plane, net):
        plane.election.set_root(root_of((ISSUER.peer_id,)))
        plane.election.campaign()
        assert await plane.election.wait_until_coordinator(10)
        a = alloc(term=plane.election.term, pipelines=[[IDS[1].peer_id, IDS[2].peer_id]], spares=(ISSUER.peer_id,),
                  absent=(IDS[3].peer_id,))
        reply = await net.request(ISSUER, ControlMsg.ALLOCATION, SignedAllocation.sign(a, ISSUER).to_wire()
                                  | {"cert": plane.election.certificate.to_wire()})
        assert reply["accepted"]
        plane.coordinator.hand.steplog = StepLog(a, set(), started_at=time.time())
        plane.coordinator.hand.phase = Phase.TRAINING
        for step in range(3):
            for p, loss in ((IDS[1], None), (IDS[2], 4.0 - step)):
                await net.request(p, ControlMsg.STEP, StepReport(1, step, loss, 0.5, 0.3, 0.1, 0.1).to_wire() | {"run": RUN})
        lines = [json.loads(x) for x in (tmp_path / f"train-{RUN.hex()}.jsonl").read_text().splitlines()]
        assert [(x["run"], x["step"], x["loss"]) for x in lines] == [(RUN.hex(), s, 4.0 - s) for s in range(3)]
        assert (tmp_path / "train.jsonl").read_text() == (tmp_path / f"train-{RUN.hex()}.jsonl").read_text()
        # the status names the run's step log, as `train start` does
        assert plane.status()["issued"]["log"] == str(tmp_path / f"train-{RUN.hex()}.jsonl")

        answer = await net.request(IDS[1], ControlMsg.RUN_STATE, {"op": "progress", "run": None, "after": 0})
        p = RunProgress.from_wire(answer)
        assert (p.run_id, p.coordinator, p.state, p.epoch, p.shape, p.completed, p.steps) == (
            RUN, ISSUER.peer_id, "training", 1, "2x1", 3, 10)
        assert [(x.step, x.loss) for x in p.lines] == [(1, 3.0), (2, 2.0)]
        tokens = CFG.global_batch_seqs * PRESETS["tiny"].seq_len
        assert p.tokens_per_s == pytest.approx(tokens / 0.5) and p.eta_s == pytest.approx(7 * 0.5)
        assert p.stop_step is None  # no operator stopped it
        stopped = dataclasses.replace(p, state="stopped", stop_step=5)
        assert RunProgress.from_wire(stopped.to_wire()) == stopped
        with pytest.raises(ProtocolError):
            RunProgress.from_wire(stopped.to_wire() | {"stop_step": -1})
        refused = await net.request(IDS[3], ControlMsg.RUN_STATE, {"op": "progress", "run": None, "after": -1})
        assert "peers of the run" in refused["error"] and "ask a daemon of the run" in refused["error"]
        other = await net.request(IDS[1], ControlMsg.RUN_STATE, {"op": "progress", "run": b"o" * 16, "after": -1})
        assert f"train-{(b'o' * 16).hex()}.jsonl" in other["error"]
        with pytest.raises(ProtocolError):
            await net.request(IDS[1], ControlMsg.RUN_STATE, {"op": "progress", "run": None, "after": "x"})

        peer = IDS[1]
        relay = SwarmTransport(peer, {ISSUER.peer_id: RelayConn(net, peer)})
        follower = ControlPlane(relay, peer, FakeGossip(IDS[:4]), tmp_path / "n1", config(tmp_path),
                                operators=[OPERATOR.public_key])
        follower.election.set_root(root_of((ISSUER.peer_id,)))  # (as the run's allocation gave it)
        seen = await follower.operator.train_progress(None, 1)
        assert seen.coordinator == ISSUER.peer_id and [x.step for x in seen.lines] == [2]
        assert follower.election.coordinator == ISSUER.peer_id  # recognised: its certificate checks against the council
        # the run finishes: its last answer says so, with no ETA
        plane.coordinator.steplog.completed = 9
        plane.coordinator.hand.phase = Phase.FINISHED
        done = await follower.operator.train_progress(RUN, 2)
        assert (done.state, done.completed, done.lines, done.eta_s) == ("finished", 10, (), None)


async def test_an_idle_plane_does_not_spin(tmp_path):
    async with running(tmp_path, OTHER):
        cpu = time.process_time()
        await trio.sleep(0.5)
        assert time.process_time() - cpu < 0.1


async def test_a_coordinator_deadline_left_in_the_past_is_ticked_again_after_a_pause_not_in_a_loop(
        tmp_path, autojump_clock, caplog):
    # The machine's deadline stays a second in the past after every tick (the bug of a stopped
    # run's step watch): the timer ticks it once at once, then once a PAST_DEADLINE_BACKOFF_S, and says so
    # once; a deadline that moves is kept again.
    from dtfm.control import plane as plane_mod
    from dtfm.control.coordinator.machine import CoordinatorTick
    plane = ControlPlane(FakeTransport(ISSUER), ISSUER, FakeGossip(IDS[:4]), tmp_path, config(tmp_path),
                         operators=[OPERATOR.public_key])
    due = [trio.current_time() - 1.0]
    ticks: list[float] = []
    plane.coordinator.next_deadline = lambda: due[0]
    plane._feed_coordinator = lambda ev: ticks.append(trio.current_time()) if isinstance(ev, CoordinatorTick) else None
    with trio.move_on_after(10.5):
        await plane._coordinator_timer()
    per = plane_mod.PAST_DEADLINE_BACKOFF_S
    assert len(ticks) == 1 + int(10.5 // per), ticks
    assert sum("stays in the past" in r.message for r in caplog.records) == 1
    # a machine whose tick moves its deadline on is ticked at each deadline, and only then
    ticks.clear()
    t0 = trio.current_time()
    due[0] = t0 + 100.0

    def tick(ev):
        ticks.append(trio.current_time())
        due[0] += 100.0
    plane._feed_coordinator = tick
    with trio.move_on_after(250):
        await plane._coordinator_timer()
    assert ticks == [pytest.approx(t0 + 100.0), pytest.approx(t0 + 200.0)]


@pytest.mark.parametrize("args, match", [
    ({"preset": "huge"}, "unknown preset"),
    ({"steps": 0}, "steps"),
    ({"steps": True}, "steps"),
    ({"dp": 2}, "--dp needs --stages"),
    ({"stages": -1}, "stages"),
    ({"data": 5}, "never by path"),
    ({"data": "/etc/passwd"}, "never by path"),
    ({"data_hash": "/etc/passwd"}, "data_hash must be 64 lowercase hex"),
    ({"data_hash": "ab" * 32, "data_name": 5}, "data_name"),
    ({"placement": "best"}, "placement"),
    ({"placement": "random"}, "random placement needs --stages"),
    ({"min_peers": 0}, "min_peers"),
    ({"min_peers": 2, "wait_s": -1}, "wait_s"),
    ({"min_peers": 2, "wait_s": "soon"}, "wait_s"),
    ({"compress": "zip"}, "compress: unknown compression preset 'zip'"),
    ({"compress": "diloco,inner_steps=0"}, "compress: inner_steps must be at least 1"),
    ({"compress": "diloco,flux=2"}, "compress: compression option 'flux=2'"),
    ({"compress": {"dp_method": "diloco"}}, "compress must be"),
    ({"compress": "diloco," + "x" * 600}, "at most 512"),
])
def test_train_requests_are_checked(args, match):
    with pytest.raises(TrainError, match=match):
        TrainRequest.from_args(args)


def test_a_data_set_that_cannot_feed_the_model_is_refused_at_train_start():
    # Before, a data set shorter than a sequence got as far as the peers' first step, where the
    # error ended the daemon; the coordinator now refuses the run with the reason.
    req = TrainRequest.from_args({"preset": "tiny"})
    seq = PRESETS["tiny"].seq_len
    with pytest.raises(TrainError, match=f"37 tokens, too few for preset 'tiny'.*{seq} tokens"):
        req.check_data(Corpus(np.zeros(37, dtype=np.uint8), "short.txt"))
    req.check_data(Corpus(np.zeros(seq + 2, dtype=np.uint8), "enough.txt"))
    wide = Corpus(np.full(seq + 2, PRESETS["tiny"].vocab, dtype=np.uint16), "tokens.bin")
    with pytest.raises(TrainError, match="vocabulary"):
        req.check_data(wide)


def test_a_train_request_is_signed_as_it_was_read():
    req = TrainRequest.from_args({"preset": "tiny", "steps": 7, "stages": 2, "dp": 2, "data_hash": "ab" * 32,
                                  "data_name": "x.txt", "min_peers": 3, "wait_s": 9})
    assert TrainRequest.from_args(req.to_args()) == req
    assert "data" not in req.to_args() and req.to_args()["data_hash"] == "ab" * 32
    assert "compress" not in req.to_args()  # exact: the signed start is what it was before compression
    comp = TrainRequest.from_args({**req.to_args(), "compress": " diloco, inner_steps=8,pp_method=int4"})
    assert comp.compression.inner_steps == 8 and comp.compression.pp_method == "int4"
    assert comp.to_args()["compress"] == "diloco,pp_method=int4,inner_steps=8"
    assert TrainRequest.from_args(comp.to_args()) == comp


@pytest.mark.parametrize("args, every", [({}, 20), ({"checkpoint_every": None}, 20), ({"checkpoint_every": 0}, 0),
                                         ({"checkpoint_every": 5}, 5)])
def test_a_run_checkpoints_every_20_steps_unless_the_operator_says_otherwise(args, every):
    assert TrainRequest.from_args(args).checkpoint_every == every
    with pytest.raises(TrainError, match="checkpoint_every"):
        TrainRequest.from_args({"checkpoint_every": -1})


async def test_a_forwarded_start_is_refused_before_any_work_and_no_path_is_ever_opened(tmp_path, monkeypatch):
    # A forwarded TRAIN_OP carries the operator's signed operation and nothing else: an old-style
    # request naming a path, an unsigned one, one signed by a key the swarm does not name, a
    # forged one, and a signed start that tries to name a path are all refused before this peer
    # loads anything (its own data set included); nothing of a message is ever opened as a path.
    opened: list[object] = []
    import dtfm.control.plane as plane_module
    real_load = plane_module.load_corpus
    monkeypatch.setattr(plane_module, "load_corpus", lambda path: opened.append(path) or real_load(path))
    body = pack([1, "start", OPERATOR.public_key, b"s" * 16, int(time.time() * 1000),
                 {"data": "/etc/passwd", "data_hash": CORPUS.fingerprint, "preset": "tiny"}])
    path_start = SignedOp(body, OPERATOR.sign(OPERATOR_DOMAIN + body))
    async with running(tmp_path, OTHER) as (plane, net):
        answers = [
            await net.request(ISSUER, ControlMsg.TRAIN_OP, {"op": "start", "args": {"data": "/etc/passwd"}}),
            await net.request(ISSUER, ControlMsg.TRAIN_OP, {"op": "start", "signed": start_op(INTRUDER).to_wire()}),
            await net.request(ISSUER, ControlMsg.TRAIN_OP, {
                "op": "start", "signed": dataclasses.replace(start_op(), signature=bytes(64)).to_wire()}),
            await net.request(ISSUER, ControlMsg.TRAIN_OP, {"op": "start", "signed": path_start.to_wire()}),
            await net.request(ISSUER, ControlMsg.TRAIN_OP, {"op": "stop", "signed": start_op().to_wire()}),
            await net.request(ISSUER, ControlMsg.TRAIN_OP, {
                "op": "reschedule", "signed": sign_op(INTRUDER, "reschedule", now_s=time.time(),
                                                      run_id=RUN).to_wire()}),
            await net.request(ISSUER, ControlMsg.TRAIN_OP, {
                "op": "resume", "signed": sign_op(INTRUDER, "resume", now_s=time.time(), run_id=RUN).to_wire()}),
            await net.request(ISSUER, ControlMsg.TRAIN_OP, {
                "op": "resume", "signed": sign_op(OPERATOR, "stop", now_s=time.time(), run_id=RUN).to_wire()}),
        ]
        words = ["must carry the operator's signed operation", "not an operator of this swarm",
                 "bad operator signature", "a start's arguments are", "carries an operator's start",
                 "not an operator of this swarm", "not an operator of this swarm", "carries an operator's stop"]
        for answer, w in zip(answers, words):
            assert w in answer["error"], (w, answer)
        with pytest.raises(ProtocolError):
            await net.request(ISSUER, ControlMsg.TRAIN_OP, {"op": "start", "signed": {"body": 5}})
        with pytest.raises(TrainError, match="not an operator of this swarm"):  # the local socket's op too
            await plane.operator.start_training(start_op(INTRUDER))
        with pytest.raises(TrainError, match="not an operator of this swarm"):
            await plane.operator.resume_training(sign_op(INTRUDER, "resume", now_s=time.time(), run_id=RUN))
        assert opened == [] and plane.epoch.current is None
        # a valid start reaches this peer, which is not the coordinator: still nothing opened
        answer = await net.request(ISSUER, ControlMsg.TRAIN_OP, {"op": "start", "signed": start_op().to_wire()})
        assert "not the coordinator" in answer["error"] and opened == []
        # this peer's own data set is the only one it ever loads
        assert (await plane.corpus()).fingerprint == CORPUS.fingerprint and opened == [plane.config.data_path]


class PingConn:
    """A connection that answers a gossip ping, or never does (a cut link, a frozen peer)."""

    def __init__(self, peer_id: bytes, up: bool):
        self.peer_id, self.up = peer_id, up

    async def request(self, msg_type, body, *, payload=None, timeout_s):
        if not self.up:
            await trio.sleep(timeout_s)
            raise RequestTimeout(f"no reply within {timeout_s} s")
        return {"n": body["n"]}, None


async def test_reach_pings_the_asked_peers_within_the_time_and_only_for_the_coordinator(tmp_path):
    transport = FakeTransport(OTHER)
    transport.connection = lambda peer_id: PingConn(peer_id, peer_id != IDS[3].peer_id)  # type: ignore
    async with running(tmp_path, OTHER, transport=transport) as (plane, net):
        body = ReachRequest((IDS[2].peer_id, IDS[3].peer_id, OTHER.peer_id), 0.2).to_wire()
        t0 = trio.current_time()
        answer = ReachAnswer.from_wire(await net.request(OTHER, ControlMsg.RUN_STATE, body))  # its own coordinator
        assert answer == ReachAnswer((IDS[2].peer_id,), (IDS[3].peer_id,))  # (itself is not pinged)
        assert 0.2 <= trio.current_time() - t0 < 2.0
        assert await net.request(ISSUER, ControlMsg.RUN_STATE, body) == {
            "error": "only the coordinator asks a peer to reach others"}
        for bad in ({"op": "reach", "peers": [b"x"], "timeout_s": 1.0}, {"op": "reach", "peers": [], "timeout_s": 0}):
            with pytest.raises(ProtocolError):
                await net.request(OTHER, ControlMsg.RUN_STATE, bad)


class ClaimingConn(AnsweringConn):
    """A peer that claims a council it cannot show (voters 5, no certificate), and takes roots."""

    async def request(self, msg_type, body, timeout_s=None):
        if msg_type == ControlMsg.COORDINATOR:
            return self.answer, None
        assert msg_type == ControlMsg.TRAIN_OP and body["op"] == "root"
        self.forwarded.append(body)
        return {"ok": {"voters": 3, "taken": False}}, None


async def test_a_claimed_council_does_not_keep_the_operators_start_from_rooting_one(tmp_path, autojump_clock):
    # Any key holder can answer "who is the coordinator?" claiming a council of 5 voters. On a
    # peer without a council that claim is a hint in the error, never a refusal: the operator's
    # start roots the council it names here, and its voters are handed the root.
    me = IDS[3]
    claim = {"term": 5, "role": "follower", "recognised": False, "lease": False, "voters": 5, "cert": None}
    conns = {p.peer_id: ClaimingConn(p.peer_id, claim, False) for p in IDS[:3]}
    plane = ControlPlane(SwarmTransport(me, conns), me, FakeGossip(IDS[:4]), tmp_path, config(tmp_path),
                         operators=[OPERATOR.public_key])
    council = tuple(sorted((me.peer_id, IDS[0].peer_id, IDS[1].peer_id)))
    with pytest.raises(TrainError, match="no coordinator was elected.*3 live peer\\(s\\) say they have a council"):
        await plane.operator.start_training(start_op(council=council_arg(council), council_size=3))
    assert plane.election.council is not None and plane.election.council.voters == council
    assert [len(c.forwarded) > 0 for c in conns.values()] == [p.peer_id in council for p in IDS[:3]]
    assert all(b["op"] == "root" for c in conns.values() for b in c.forwarded)


async def test_the_operators_council_operation_re_roots_a_council_and_an_older_one_changes_nothing(
        tmp_path, autojump_clock):
    # A council that lost its quorum is re-rooted only by the operator: `dtfm-peer train council`
    # signs a council operation, which replaces the council this peer holds (one the operator
    # rooted earlier), is handed to every live peer, and survives a restart (council.bin); a
    # council operation signed before the root this peer holds changes nothing; no other key's.
    me = IDS[3]
    conns = {p.peer_id: ClaimingConn(p.peer_id, {}, False) for p in IDS[:3]}
    plane = ControlPlane(SwarmTransport(me, conns), me, FakeGossip(IDS[:4]), tmp_path, config(tmp_path),
                         operators=[OPERATOR.public_key])
    plane.election.set_root(root_of((IDS[0].peer_id, IDS[1].peer_id, IDS[2].peer_id)))  # (dead for good, say)
    new = tuple(sorted((me.peer_id, IDS[1].peer_id)))
    op = sign_op(OPERATOR, "council", now_s=time.time(), args={"council": council_arg(new), "council_size": 3})
    reply = await plane.operator.reroot(op)
    assert reply == {"voters": [v.hex() for v in new], "told": 3}
    assert plane.election.council.voters == new and plane.election.council.root == op.encode()
    assert all(c.forwarded == [{"op": "root", "signed": op.to_wire()}] for c in conns.values())
    older = sign_op(OPERATOR, "council", now_s=time.time() - 60,
                    args={"council": council_arg((IDS[0].peer_id,)), "council_size": 3})
    with pytest.raises(TrainError, match="rooted by a later operation"):
        await plane.operator.reroot(older)
    with pytest.raises(TrainError, match="not an operator"):
        await plane.operator.reroot(sign_op(INTRUDER, "council", now_s=time.time(), args={"council": council_arg(new)}))
    assert plane.election.council.voters == new
    again = ControlPlane(FakeTransport(me), me, FakeGossip(IDS[:4]), tmp_path, config(tmp_path),
                         operators=[OPERATOR.public_key])
    assert again.election.council is not None and again.election.council.voters == new
