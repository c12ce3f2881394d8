"""The control plane's message handlers against hostile or mistaken input: each is refused
with its reason (or closes the connection, for a malformed body) and nothing is applied."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from dtfm.control import (
    Allocation,
    ControlPlane,
    PeerRunState,
    PlaneConfig,
    SignedAllocation,
    TrainError,
    TrainRequest,
    manifest_digest,
)
from dtfm.control.epoch.runner import StepReport
from dtfm.control.steplog import _Issued
from dtfm.gossip import Member, MemberState
from dtfm.gossip.records import Entry, Report
from dtfm.net import Identity, ProtocolError
from dtfm.train import PRESETS, TEST_CONFIG, Corpus, StageState, encode_transfer, save_checkpoint

IDS = [Identity(bytes([i]) * 32) for i in range(1, 6)]
ISSUER, OTHER, MALLORY = IDS[0], IDS[1], Identity(b"\xee" * 32)
CORPUS = Corpus(np.frombuffer(b"hello swarm " * 4096, dtype=np.uint8).copy(), "test-corpus")
CFG = dataclasses.replace(TEST_CONFIG, micro_batches=2)


class FakeGossip:
    def __init__(self, peers):
        self._members = [Member(p.peer_id, 0, MemberState.ALIVE, "127.0.0.1", 7000 + k, "r")
                         for k, p in enumerate(peers)]

    def live_peers(self):
        return sorted(m.peer_id for m in self._members)

    def members(self):
        return list(self._members)

    def on_member_change(self, cb):
        pass


class FakeTransport:
    def handle(self, msg_type, handler):
        pass

    def on_connect(self, cb):
        pass

    def on_disconnect(self, cb):
        pass

    def connection(self, peer_id):
        return None


@dataclasses.dataclass
class Conn:
    peer_id: bytes
    short_id: str = "peer"


def make_plane(tmp_path: Path, me: Identity) -> ControlPlane:
    plane = ControlPlane(FakeTransport(), me, FakeGossip(IDS[:4]), tmp_path, PlaneConfig())
    plane._corpora[None] = CORPUS
    return plane


def alloc(**kw) -> Allocation:
    fields = dict(epoch=1, term=0, issuer=ISSUER.peer_id, run_id=b"r" * 16,
                  pipelines=[[IDS[0].peer_id, IDS[1].peer_id], [IDS[2].peer_id, IDS[3].peer_id]],
                  layer_ranges=[(0, 2), (2, 4)], preset="tiny", model=PRESETS["tiny"], train=CFG,
                  data_hash=CORPUS.fingerprint, data_name=CORPUS.name, start_step=0, end_step=10)
    fields.update(kw)
    return Allocation(**fields)


async def test_forged_allocation_is_refused_with_the_reason(tmp_path):
    plane = make_plane(tmp_path, OTHER)
    signed = SignedAllocation.sign(alloc(), ISSUER)
    forged = SignedAllocation(signed.body, bytes(64))
    reply = await plane._on_allocation(Conn(ISSUER.peer_id), 64, forged.to_wire(), None)
    assert reply["accepted"] is False and reply["code"] == "bad-allocation"
    assert "signature" in reply["reason"]
    assert plane._run is None


async def test_garbage_allocation_is_refused(tmp_path):
    plane = make_plane(tmp_path, OTHER)
    reply = await plane._on_allocation(Conn(ISSUER.peer_id), 64, {"body": b"\x00", "sig": b"x"}, None)
    assert reply["accepted"] is False and reply["code"] == "bad-allocation"
    assert plane._run is None


async def test_allocation_for_another_data_set_names_the_flag(tmp_path):
    plane = make_plane(tmp_path, OTHER)
    other = alloc(data_hash="0" * 64, data_name="issuer.txt")
    reply = await plane._on_allocation(Conn(ISSUER.peer_id), 64, SignedAllocation.sign(other, ISSUER).to_wire(), None)
    assert reply["accepted"] is False and reply["code"] == "data-mismatch"
    assert "--data" in reply["reason"] and plane._run is None


async def test_allocation_naming_an_unknown_peer_is_refused(tmp_path):
    plane = make_plane(tmp_path, OTHER)
    bad = alloc(pipelines=[[IDS[0].peer_id, IDS[1].peer_id], [IDS[2].peer_id, MALLORY.peer_id]])
    reply = await plane._on_allocation(Conn(ISSUER.peer_id), 64, SignedAllocation.sign(bad, ISSUER).to_wire(), None)
    assert reply["accepted"] is False and reply["code"] in ("unknown-peer", "dead-peer")
    assert plane._run is None


async def test_start_stop_and_step_reports_are_checked(tmp_path):
    plane = make_plane(tmp_path, OTHER)
    # no accepted epoch: START is refused, STOP is refused, nothing runs
    assert (await plane._on_start(Conn(ISSUER.peer_id), 65, {"run": b"r" * 16, "epoch": 1}, None))["started"] is False
    assert (await plane._on_stop(Conn(ISSUER.peer_id), 66, {"run": b"r" * 16, "at_step": 3}, None))["stopped"] is False
    with pytest.raises(ProtocolError):
        await plane._on_start(Conn(ISSUER.peer_id), 65, [1, 2], None)
    with pytest.raises(ProtocolError):
        await plane._on_stop(Conn(ISSUER.peer_id), 66, "stop", None)
    with pytest.raises(ProtocolError):
        await plane._on_step(Conn(ISSUER.peer_id), 67, {"epoch": "x", "step": 1}, None)
    # a report for a run this peer did not issue is ignored
    await plane._on_step(Conn(ISSUER.peer_id), 67, {"run": b"r" * 16, "epoch": 1, "step": 0, "loss": 1.0,
                                                     "iteration_s": 1.0, "compute_s": 0.1, "pipeline_s": 0.5,
                                                     "sync_s": 0.1}, None)
    assert plane._issued is None


@pytest.mark.parametrize("args, match", [
    ({"preset": "huge"}, "unknown preset"),
    ({"steps": 0}, "steps"),
    ({"steps": True}, "steps"),
    ({"dp": 2}, "--dp needs --stages"),
    ({"stages": -1}, "stages"),
    ({"data": 5}, "data"),
    ({"min_peers": 0}, "min_peers"),
    ({"min_peers": 2, "wait_s": -1}, "wait_s"),
    ({"min_peers": 2, "wait_s": "soon"}, "wait_s"),
])
def test_train_requests_are_checked(args, match):
    with pytest.raises(TrainError, match=match):
        TrainRequest.from_args(args)


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_allocation_of_an_unrecognised_coordinator_is_refused(tmp_path, autojump_clock):
    # This peer knows no coordinator of term 3: the issuer may not allocate, whatever it signs.
    plane = make_plane(tmp_path, OTHER)
    signed = SignedAllocation.sign(alloc(term=3), ISSUER)
    reply = await plane._on_allocation(Conn(ISSUER.peer_id), 64, signed.to_wire(), None)
    assert reply["accepted"] is False and reply["code"] == "not-coordinator"
    assert plane._run is None and plane.election.last_applied == (0, 0)


async def test_a_resumed_epoch_without_holders_is_refused_never_reinitialised(tmp_path, autojump_clock):
    plane = make_plane(tmp_path, OTHER)
    a = alloc(start_step=5)
    refusal = None
    plane.election.may_apply = lambda issuer, term, epoch: refusal  # the issuer is the coordinator
    plane.election.applied = lambda term, epoch: None
    plane.election.set_voters = lambda voters: None
    reply = await plane.accept(a)
    assert reply["accepted"] is False and reply["code"] == "build-failed"
    assert "names no holders" in reply["reason"]


async def test_run_state_requests_are_checked(tmp_path, autojump_clock):
    plane = make_plane(tmp_path, OTHER)
    state = PeerRunState.from_wire(await plane._on_run_state(Conn(ISSUER.peer_id), 71, {"op": "query"}, None))
    assert state.run_id is None and state.layers is None and not state.running
    # only the coordinator asks for offers
    reply = await plane._on_run_state(Conn(ISSUER.peer_id), 71,
                                      {"op": "offer", "run": b"r" * 16, "step": 1, "layers": [0, 2]}, None)
    assert "error" in reply
    for bad in ({"op": "nuke"}, {"op": "offer", "run": b"short", "step": 1, "layers": [0, 2]},
                {"op": "offer", "run": b"r" * 16, "step": -1, "layers": [0, 2]},
                {"op": "offer", "run": b"r" * 16, "step": 1, "layers": "all"}, [1, 2]):
        with pytest.raises(ProtocolError):
            await plane._on_run_state(Conn(ISSUER.peer_id), 71, bad, None)


async def test_next_configuration_changes_one_voter_at_a_time(tmp_path, autojump_clock):
    plane = make_plane(tmp_path, OTHER)
    ids = sorted(p.peer_id for p in IDS[:4])
    plane.election.set_voters(ids)
    a, b, c, d = ids
    me = OTHER.peer_id
    assert me in ids
    # two voters gone (unreachable, not named): one leaves now, the other at a later epoch
    gone = [x for x in ids if x != me][:2]
    named = set(ids) - set(gone)
    nxt = plane._next_voters(named, reachable=named)
    assert len(set(ids) ^ set(nxt)) == 1 and set(nxt) < set(ids)
    # two new peers named: one joins the voters now
    new = [bytes([0xA0]) * 32, bytes([0xB0]) * 32]
    nxt = plane._next_voters(set(ids) | set(new), reachable=set(ids) | set(new))
    assert set(nxt) - set(ids) == {min(new)} and set(ids) <= set(nxt)
    # nothing to change: the same voters; the issuer is always one
    assert plane._next_voters(set(ids), reachable=set(ids)) == tuple(ids)
    assert me in plane._next_voters({me}, reachable={me})


async def test_a_restarted_peer_knows_the_run_it_applied(tmp_path, autojump_clock):
    plane = make_plane(tmp_path, OTHER)
    a = alloc(term=2, epoch=3)
    plane._save_applied(a)
    again = make_plane(tmp_path, OTHER)
    assert again.election.last_applied == (2, 3) and again._applied[a.run_id] == (2, 3)
    assert again._run is not None and again._run.alloc == a and again._run.state is None
    assert again.status()["state"] == "waiting"
    state = again.run_state()
    assert state.run_id == a.run_id and (state.term, state.epoch) == (2, 3) and state.layers is None
    (tmp_path / "applied.json").write_text('{"run": "zz"}')
    with pytest.raises(TrainError, match="damaged"):
        make_plane(tmp_path, OTHER)


async def test_a_checkpoint_is_listed_and_offered_for_a_rollback(tmp_path, autojump_clock):
    # Checkpoints live in one folder per run: run r's is listed and offered; another run's
    # checkpoint of the same layers is neither (its weights are not this run's).
    plane = make_plane(tmp_path, OTHER)
    run, other_run = b"r" * 16, b"o" * 16
    state = StageState(PRESETS["tiny"], CFG, (0, 2))
    state.step = 4
    save_checkpoint(plane._checkpoint_root(run), state)
    state.step = 8
    save_checkpoint(plane._checkpoint_root(other_run), state)
    assert plane._checkpoints(run) == ((0, 2, 4),) and plane._checkpoints(other_run) == ((0, 2, 8),)
    assert plane.run_state().checkpoints == ()  # no run applied: none to report
    state.step = 4
    reply = await plane.offer(run, 4, (0, 2))
    manifest, _ = encode_transfer(state)
    assert reply["digest"] == manifest_digest(manifest) and reply["bytes"] == manifest.total_bytes
    assert "error" in await plane.offer(run, 5, (0, 2))  # no stage, snapshot or checkpoint at 5
    assert "error" in await plane.offer(run, 8, (0, 2))  # another run's step 8


class MeasuredGossip(FakeGossip):
    """FakeGossip with measurement reports: `measure(ids)` has each of `ids` report the others."""

    def __init__(self, peers):
        super().__init__(peers)
        self.records = type("Records", (), {"reports": {}})()

    def measure(self, ids):
        for a in ids:
            self.records.reports[a.peer_id] = Report.create(
                a, 1, 0.0, 1.0, [Entry(b.peer_id, 10.0, 1.0, 5) for b in ids if b is not a])


async def test_train_start_waits_for_the_minimum_swarm_size(tmp_path, autojump_clock):
    # Four peers are live but only two are measured: `--min-peers 3` waits (and says so in the
    # status) until a third is measured; `--min-peers 4` gives up after its wait with the count.
    gossip = MeasuredGossip(IDS[:4])
    plane = ControlPlane(FakeTransport(), IDS[0], gossip, tmp_path, PlaneConfig())
    gossip.measure(IDS[:2])
    done = trio.Event()

    async def start():
        await plane._await_swarm(TrainRequest(min_peers=3, wait_s=60))
        done.set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(start)
        await trio.sleep(20)
        assert not done.is_set()
        assert plane.status()["waiting_for_peers"] == {"have": 2, "want": 3, "live": 4}
        gossip.measure(IDS[:3])
        with trio.fail_after(2):
            await done.wait()
    assert "waiting_for_peers" not in plane.status()
    start_at = trio.current_time()
    with pytest.raises(TrainError, match="only 3 of the 4 peers"):
        await plane._await_swarm(TrainRequest(min_peers=4, wait_s=5))
    assert trio.current_time() - start_at == pytest.approx(5)


def report(epoch: int, step: int) -> StepReport:
    return StepReport(epoch, step, 5.0 - step / 10, 1.0, 0.5, 0.3, 0.2)


async def test_a_step_whose_every_report_was_lost_is_filled_from_the_peers(tmp_path, autojump_clock):
    # Step 1's reports all went missing on the way to the coordinator: once step 2 has every
    # report, the coordinator asks the peers for the reports they keep and logs step 1 from them,
    # while the epoch runs on; a step no peer kept is given up without a line.
    plane = make_plane(tmp_path, ISSUER)
    a = alloc()
    plane._issued = issued = _Issued(a, tmp_path / "train.jsonl", set())
    asked = []

    async def query_states(peers, **kw):
        asked.append(sorted(peers))
        return {p: PeerRunState(a.run_id, 0, a.epoch, None, None, None, True, (),
                                tuple(report(a.epoch, s) for s in (0, 1, 2, 3))) for p in peers}
    plane._query_states = query_states
    async with trio.open_nursery() as nursery:
        plane._nursery = nursery
        for step in (0, 2):
            for p in a.peers:
                plane._record_step(p, report(a.epoch, step), a.run_id)
        assert issued.gaps == {1} and issued.filling
    assert asked == [sorted(a.peers)] and not issued.filling and not issued.gaps
    lines = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [(x["step"], x.get("backfilled", False)) for x in lines] == [(0, False), (2, False), (1, True)]
    assert lines[2]["loss"] == report(a.epoch, 1).loss and lines[2]["epoch"] == a.epoch
    # Steps 4 and 5 lost, then 6 complete: the peers kept up to step 3 only.
    for p in a.peers:
        plane._record_step(p, report(a.epoch, 3), a.run_id)
    async with trio.open_nursery() as nursery:
        plane._nursery = nursery
        for p in a.peers:
            plane._record_step(p, report(a.epoch, 6), a.run_id)
    assert issued.completed == 6 and not issued.gaps
    steps = [json.loads(x)["step"] for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert steps == [0, 2, 1, 3, 6]


def test_backfill_logs_each_step_once_from_its_newest_run(tmp_path):
    # Steps 0-3 from the peers' reports: step 2 ran in epochs 1 and 3 (re-run after a rollback),
    # the epoch-3 run is logged; step 1 is logged already; step 3 has no report.
    issued = _Issued(alloc(epoch=4, start_step=4), tmp_path / "train.jsonl", {1})
    reports = [report(1, 0), report(1, 1), report(1, 2), dataclasses.replace(report(3, 2), loss=9.0)]
    lines = issued.backfill(reports, {0, 1, 2, 3})
    assert [(x["step"], x["epoch"], x["loss"], x["backfilled"]) for x in lines] == [
        (0, 1, report(1, 0).loss, True), (2, 3, 9.0, True)]
    assert issued.logged == {0, 1, 2} and issued.backfill(reports, {0, 2}) == []
