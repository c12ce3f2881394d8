"""ElectionService, the trio driver of the election, over the in-memory network under MockClock:
election, take-over after a kill, partitions, a returning peer, durability, bad input."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import trio
import trio.testing

from dtfm.control.election import (
    MAX_TERM,
    BecameCoordinator,
    CoordinatorKnown,
    ElectionConfig,
    ElectionSend,
    ElectionService,
    ElectionState,
    ElectionStoreError,
    FileElectionStore,
    MemoryElectionStore,
    Persist,
    PreVote,
    RequestVote,
    SteppedDown,
    Vote,
    decode_election,
)
from dtfm.control.election.service import DIAL_TIMEOUT_S
from dtfm.control.messages import ControlMsg
from dtfm.net import Identity, MemNetwork, TransportConfig, uniform_link, unpack_untrusted

CFG = ElectionConfig.test()
DELAY_S = 0.01  # one-way, every link
WALL0 = 1.7e9


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


class FailingStore(MemoryElectionStore):
    """Loads fine; every write fails, as a full disk would."""

    def persist(self, term, voted_for):
        raise ElectionStoreError("cannot write election.json: No space left on device")


class Swarm:
    """n ElectionServices on one MemNetwork; records every event and every election frame sent."""

    def __init__(self, n: int, *, seed: int = 0, config: ElectionConfig = CFG, stores=None, finder: bool = False) -> None:
        self.finder = finder  # each service asks the others who the coordinator is when it hears none
        self.rng = random.Random(seed)
        self.n = n
        self.config = config
        keys = [Identity(self.rng.randbytes(32)) for _ in range(n)]  # real keys: votes are signatures
        self.signers = {key.peer_id: key for key in keys}
        self.ids = sorted(self.signers)
        self.index = {p: k for k, p in enumerate(self.ids)}
        self.net = MemNetwork(uniform_link(DELAY_S), config=TransportConfig.test(), seed=seed)
        self.stores = stores if stores is not None else [MemoryElectionStore() for _ in range(n)]
        self.transports: list = [None] * n
        self.services: list[ElectionService | None] = [None] * n
        self.scopes: list[trio.CancelScope | None] = [None] * n
        self.events: list[tuple[float, int, object]] = []  # (time, node, event)
        self.failures: dict[int, BaseException] = {}
        self.sent: list[tuple[float, int, int, object]] = []  # (time, src, dst, message) as they leave
        self.dials: dict[tuple[int, int], int] = defaultdict(int)  # (src, dst) -> dials
        self.on_send = None  # called with (src, dst, message) as a frame leaves
        self.hang: set[int] = set()  # dials to these nodes never complete (a black-holed address)
        transmit = self.net.transmit

        def recording_transmit(src, dst, frame, size):
            if frame.msg_type == ControlMsg.ELECTION and frame.kind == 0 and src.peer_id in self.index:
                msg = decode_election(unpack_untrusted(frame.data, max_len=1 << 16))
                s, d = self.index[src.peer_id], self.index.get(dst.peer_id, -1)
                self.sent.append((trio.current_time(), s, d, msg))
                if self.on_send is not None:
                    self.on_send(s, d, msg)
            transmit(src, dst, frame, size)

        self.net.transmit = recording_transmit

    async def start(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        await nursery.start(self.net.run)
        for k in range(self.n):
            await self.start_node(k)

    async def start_node(self, k: int) -> None:
        t = self.net.add(self.ids[k])
        connect = t.connect

        async def counting_connect(host, port, *, peer_id=None):
            self.dials[(k, self.index.get(peer_id, -1))] += 1
            if self.index.get(peer_id) in self.hang:
                await trio.sleep_forever()
            return await connect(host, port, peer_id=peer_id)

        t.connect = counting_connect
        svc = ElectionService(t, self.ids[k], self.stores[k], self.config, signer=self.signers[self.ids[k]],
                              address_of=self.address_of, rng=random.Random(self.rng.random()),
                              wall_clock=lambda: WALL0 + trio.current_time(),
                              peers=(lambda: [p for i, p in enumerate(self.ids) if i in self.alive()])
                              if self.finder else None)
        svc.on_event(lambda e, k=k: self.events.append((trio.current_time(), k, e)))
        self.transports[k], self.services[k], self.scopes[k] = t, svc, trio.CancelScope()
        await self.nursery.start(self._run_node, k)

    async def _run_node(self, k: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.scopes[k]:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.transports[k].serve)
                await nursery.start(self._run_service, k)
                task_status.started()

    async def _run_service(self, k: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self.services[k].run(task_status=task_status)
        except ElectionStoreError as e:
            self.failures[k] = e

    def address_of(self, peer: bytes):
        return self.transports[self.index[peer]].listen_address

    def kill(self, k: int) -> None:
        self.transports[k].kill()
        self.scopes[k].cancel()

    def alive(self) -> list[int]:
        return [k for k in range(self.n) if not self.transports[k].killed and k not in self.failures]

    def partition(self, *groups) -> None:
        for i, g in enumerate(groups):
            for h in groups[i + 1:]:
                for a in g:
                    for b in h:
                        self.net.cut_link(self.ids[a], self.ids[b])

    def set_voters(self) -> None:
        for k in self.alive():
            self.services[k].set_voters(self.ids)

    def coordinators(self, among=None) -> list[int]:
        return [k for k in (self.alive() if among is None else among) if self.services[k].is_coordinator]

    def agreed(self, among=None) -> int | None:
        """The node every one of `among` (default: the living) recognises and that is coordinator."""
        among = self.alive() if among is None else among
        known = {self.services[k].coordinator for k in among}
        if len(known) != 1 or None in known:
            return None
        c = self.index[known.pop()]
        return c if self.coordinators(among) == [c] else None

    def became(self, after: float = -1.0) -> list[tuple[float, int, int]]:
        """(time, node, term) of each BecameCoordinator after `after`."""
        return [(t, k, e.term) for t, k, e in self.events if isinstance(e, BecameCoordinator) and t > after]

    def check_one_coordinator_per_term(self) -> None:
        by_term = defaultdict(set)
        for _, k, term in self.became():
            by_term[term].add(k)
        assert all(len(ks) == 1 for ks in by_term.values()), dict(by_term)


async def until(pred, limit_s: float, step_s: float = 0.005) -> float:
    """Poll pred() until true (fail after limit_s of virtual time); the time it became true."""
    with trio.fail_after(limit_s):
        while not pred():
            await trio.sleep(step_s)
    return trio.current_time()


async def elect(s: Swarm, k: int, limit_s: float = 1.0) -> int:
    """Voters set on all, node k campaigns; returns its term once every node follows it."""
    s.set_voters()
    s.services[k].campaign()
    assert await s.services[k].wait_until_coordinator(limit_s)
    await until(lambda: s.agreed() == k, limit_s)
    return s.services[k].term


async def test_campaign_elects_one_coordinator_all_recognise(autojump_clock):
    async with trio.open_nursery() as nursery:
        s = Swarm(5, seed=1)
        await s.start(nursery)
        s.set_voters()
        t0 = trio.current_time()
        s.services[2].campaign()
        assert await s.services[2].wait_until_coordinator(1.0)
        # pre-votes out and back, then the vote requests out and back: four one-way delays (plus
        # microseconds on the wire at 1 Gb/s)
        assert trio.current_time() - t0 == pytest.approx(4 * DELAY_S, abs=1e-4)
        for k in (0, 1, 3, 4):
            assert await s.services[k].wait_for_coordinator(1.0) == s.ids[2]
            assert not s.services[k].is_coordinator
        leader = s.services[2]
        assert (leader.role, leader.term, leader.coordinator, leader.voters) == ("coordinator", 1, s.ids[2],
                                                                                 tuple(s.ids))
        assert leader.status() == {"role": "coordinator", "term": 1, "coordinator": s.ids[2].hex(), "voters": 5,
                                   "applied": [0, 0], "since": pytest.approx(WALL0 + t0 + 4 * DELAY_S, abs=1e-4),
                                   "term_exhausted": False, "heard_of": None,
                                   "quorum": 4, "live_voters": 5, "gone_voters": []}
        assert s.services[0].status()["role"] == "follower"
        # it stays the only coordinator while heartbeats flow
        await trio.sleep(20 * CFG.election_timeout_max_s)
        assert s.became() == [(pytest.approx(t0 + 4 * DELAY_S, abs=1e-4), 2, 1)]
        assert all(s.services[k].term == 1 and s.services[k].coordinator == s.ids[2] for k in range(5))
        # each follower reported the coordinator once, as an event
        known = [(k, e.coordinator) for _, k, e in s.events if isinstance(e, CoordinatorKnown)]
        assert sorted(known) == [(k, s.ids[2]) for k in range(5)]
        # allocations: only the coordinator's, with its certificate, of its term, newer than the last applied
        cert = leader.certificate
        assert cert.term == 1 and cert.candidate == s.ids[2] and s.services[0].certificate == cert
        council = s.services[0].council
        assert council is not None and council.voters == tuple(s.ids)
        assert s.services[0].may_apply(s.ids[2], 1, 1, cert, council) is None
        assert s.services[0].may_apply(s.ids[2], 1, 1, None, council).code == "bad-certificate"
        assert s.services[0].may_apply(s.ids[3], 1, 1, cert, council).code == "bad-certificate"
        s.services[0].apply_allocation(1, 1, council, cert)
        assert s.services[0].last_applied == (1, 1)
        assert s.services[0].may_apply(s.ids[2], 1, 1, cert, council).code == "stale"
        s.check_one_coordinator_per_term()
        nursery.cancel_scope.cancel()


async def test_a_killed_coordinator_is_replaced_within_the_timeouts(autojump_clock):
    async with trio.open_nursery() as nursery:
        s = Swarm(5, seed=2)
        await s.start(nursery)
        term = await elect(s, 0)
        await trio.sleep(1.0)
        t_kill = trio.current_time()
        s.kill(0)
        t_new = await until(lambda: s.agreed() is not None, 5.0)
        new = s.agreed()
        took = t_new - t_kill
        # the followers heard the last heartbeat at most one interval (plus a delay) before the
        # kill; the first-ranked survivor stands within election_timeout_max_s of it (the dead
        # coordinator ranks last), and its pre-votes and votes take four one-way delays
        assert CFG.election_timeout_min_s - CFG.heartbeat_interval_s - DELAY_S <= took
        assert took <= CFG.election_timeout_max_s + 4 * DELAY_S + 1e-9
        assert s.services[new].term > term
        assert all(s.services[k].term == s.services[new].term for k in s.alive())
        # the dead peer is redialled with back-off, not at every heartbeat
        dials_before = s.dials[(new, 0)]
        await trio.sleep(10.0)
        dials = s.dials[(new, 0)] - dials_before
        assert 1 <= dials <= 10.0 / (2 * CFG.election_timeout_min_s)  # heartbeats: 10.0 / heartbeat_interval_s
        assert s.agreed() == new
        s.check_one_coordinator_per_term()
        nursery.cancel_scope.cancel()


async def test_a_peer_whose_dials_hang_delays_no_one(autojump_clock):
    async with trio.open_nursery() as nursery:
        s = Swarm(4, seed=8)
        await s.start(nursery)
        s.hang.add(3)
        s.kill(3)
        s.set_voters()
        t0 = trio.current_time()
        s.services[0].campaign()
        assert await s.services[0].wait_until_coordinator(1.0)
        assert trio.current_time() - t0 == pytest.approx(4 * DELAY_S, abs=1e-4)
        await trio.sleep(10.0)
        # heartbeats kept flowing to 1 and 2 (3 of 4 voters ack: no step-down), while the dials
        # to 3 each waited out their timeout and then a back-off
        assert s.agreed() == 0 and s.became() == [(pytest.approx(t0 + 4 * DELAY_S, abs=1e-4), 0, 1)]
        assert 2 <= s.dials[(0, 3)] <= 10.0 / (DIAL_TIMEOUT_S + CFG.election_timeout_min_s) + 1
        nursery.cancel_scope.cancel()


async def test_partition_minority_coordinator_steps_down_majority_elects_heal_joins(autojump_clock):
    async with trio.open_nursery() as nursery:
        s = Swarm(6, seed=3)
        await s.start(nursery)
        term = await elect(s, 0)
        await trio.sleep(0.5)
        t_cut = trio.current_time()
        minority, majority = [0, 1], [2, 3, 4, 5]  # the other side is a quorum of six (4)
        s.partition(minority, majority)
        # check-quorum: no acks from a quorum within lease_s -> steps down at a heartbeat tick;
        # the last acked heartbeat left up to a heartbeat interval and a round trip before the cut
        t_down = await until(lambda: s.services[0].role != "coordinator", 2.0, step_s=0.001)
        assert CFG.lease_s - CFG.heartbeat_interval_s - 2 * DELAY_S <= t_down - t_cut
        assert t_down - t_cut <= CFG.lease_s + CFG.heartbeat_interval_s
        stepped = [e for _, k, e in s.events if k == 0 and isinstance(e, SteppedDown)]
        assert len(stepped) == 1 and "quorum" in stepped[0].reason
        t_new = await until(lambda: s.agreed(majority) is not None, 5.0)
        # the last heartbeat arrived up to a delay after the cut; the first-ranked peer of the
        # majority stands within election_timeout_max_s plus a stagger (1 of the minority may rank
        # ahead of it; the old coordinator ranks last), then four delays of pre-votes and votes
        assert t_new - t_cut <= DELAY_S + CFG.election_timeout_max_s + CFG.stagger_s + 4 * DELAY_S + 1e-3
        new = s.agreed(majority)
        # a long partition: the minority never elects, and its terms do not even rise (pre-vote)
        await trio.sleep(10.0)
        assert [k for _, k, _ in s.became(after=t_cut)] == [new]
        assert s.coordinators(minority) == []
        assert [s.services[k].term for k in minority] == [term, term]
        assert s.agreed(majority) == new
        s.net.heal()
        try:
            await until(lambda: s.agreed() == new, 2.0)
        except trio.TooSlowError:
            for k in range(6):
                print(k, s.services[k].status(), s.services[k].is_coordinator)
            raise
        assert {s.services[k].term for k in range(6)} == {term + 1}
        await trio.sleep(2.0)
        assert s.agreed() == new and [k for _, k, _ in s.became(after=t_cut)] == [new]
        s.check_one_coordinator_per_term()
        nursery.cancel_scope.cancel()


async def test_returning_peer_with_a_higher_term_keeps_the_coordinator(autojump_clock):
    async with trio.open_nursery() as nursery:
        s = Swarm(5, seed=4)
        await s.start(nursery)
        term = await elect(s, 0)
        # cut off for ten election timeouts: its timers fire, its pre-votes are lost
        s.partition([4], [0, 1, 2, 3])
        await trio.sleep(10 * CFG.election_timeout_max_s)
        assert s.services[4].term == term and s.services[4].role == "pre-candidate"
        s.net.heal()
        await trio.sleep(1.0)
        assert s.agreed() == 0 and {s.services[k].term for k in range(5)} == {term}
        # again, but it restarts with a term raised by 5 in its store
        s.partition([4], [0, 1, 2, 3])
        await trio.sleep(1.0)
        s.kill(4)
        s.stores[4].term += 5
        s.stores[4].voted_for = None
        t_back = trio.current_time()
        await s.start_node(4)
        s.services[4].set_voters(s.ids)  # the configuration the daemon keeps with its allocation
        assert s.services[4].term == term + 5
        s.net.heal()
        await until(lambda: s.agreed() == 0 and s.services[0].term == term + 6, 3.0)
        # the same coordinator, one term above the returning peer's: it stood again at once
        assert [k for _, k, _ in s.became(after=t_back)] == [0]
        assert [e.standing_again for _, k, e in s.events if k == 0 and isinstance(e, SteppedDown)] == [True]
        await trio.sleep(2.0)
        assert s.agreed() == 0 and {s.services[k].term for k in range(5)} == {term + 6}
        s.check_one_coordinator_per_term()
        nursery.cancel_scope.cancel()


async def test_file_store_vote_on_disk_before_it_leaves_and_survives_restart(tmp_path):
    # Real time: the store writes in worker threads, and MockClock's autojump would race ahead
    # while they fsync. Timeouts long enough that a loaded machine causes no second election.
    config = CFG.with_(election_timeout_min_s=1.0, election_timeout_max_s=1.2, stagger_s=0.2,
                       heartbeat_interval_s=0.05, lease_s=0.8)
    dirs = [tmp_path / f"peer{k}" for k in range(3)]
    async with trio.open_nursery() as nursery:
        s = Swarm(3, seed=5, config=config, stores=[FileElectionStore(d) for d in dirs])
        checked = []

        def vote_on_disk(src, dst, msg):
            if isinstance(msg, Vote) and msg.granted:
                assert FileElectionStore(dirs[src]).load() == (msg.term, s.ids[dst])
                checked.append((src, msg.term))
            if isinstance(msg, RequestVote):
                assert FileElectionStore(dirs[src]).load() == (msg.term, s.ids[src])
                checked.append((src, msg.term))

        s.on_send = vote_on_disk
        await s.start(nursery)
        term = await elect(s, 0, limit_s=10.0)
        assert sorted(checked) == [(0, term), (0, term), (1, term), (2, term)]
        assert s.services[1].voted_for == s.ids[0]
        s.kill(1)
        await trio.sleep(0.1)
        # a new service on the same directory loads the term and the vote
        again = ElectionService(s.net.add(s.ids[1]), s.ids[1], FileElectionStore(dirs[1]), config,
                                signer=s.signers[s.ids[1]])
        assert (again.term, again.voted_for, again.role) == (term, s.ids[0], "follower")
        await s.start_node(1)
        s.services[1].set_voters(s.ids)
        assert (s.services[1].term, s.services[1].voted_for) == (term, s.ids[0])
        await until(lambda: s.agreed() == 0, 10.0)
        assert s.services[1].term == term
        s.check_one_coordinator_per_term()
        nursery.cancel_scope.cancel()


async def test_a_failed_persist_stops_the_service_and_the_vote_never_leaves(autojump_clock):
    async with trio.open_nursery() as nursery:
        s = Swarm(3, seed=6, stores=[MemoryElectionStore(), FailingStore(), MemoryElectionStore()])
        await s.start(nursery)
        s.set_voters()
        s.services[0].campaign()
        assert await s.services[0].wait_until_coordinator(1.0)  # with 2's vote
        t_fail = await until(lambda: 1 in s.failures, 1.0)
        assert "No space left" in str(s.failures[1])
        assert not [m for _, k, _, m in s.sent if k == 1 and isinstance(m, Vote)]
        assert await s.services[2].wait_for_coordinator(1.0) == s.ids[0]
        # a stopped service ignores what arrives and what the control plane asks
        svc = s.services[1]
        svc.campaign()
        await trio.sleep(1.0)
        assert svc.role == "follower" and not svc.is_coordinator
        assert [m for t, k, _, m in s.sent if k == 1 and t >= t_fail] == []
        nursery.cancel_scope.cancel()


async def test_run_raises_the_store_error_and_sends_nothing(autojump_clock):
    net = MemNetwork(uniform_link(DELAY_S), config=TransportConfig.test())
    key = Identity(b"\x01" * 32)
    me, other = key.peer_id, b"\x02" * 32
    t = net.add(me)
    svc = ElectionService(t, me, FailingStore(), CFG.with_(pre_vote=False), signer=key)
    sent = []
    net.transmit = lambda *a: sent.append(a)
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        await nursery.start(t.serve)
        svc.set_voters([other, me])
        svc.campaign()  # Persist(1, me) then RequestVote: the persist fails, nothing leaves
        with pytest.raises(ElectionStoreError, match="No space left"):
            await svc.run()
        assert sent == []
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("body, payload", [({"k": 99}, None), ({"k": 3, "t": -1, "g": True}, None), ("vote", None),
                                           (Vote(1, False, 1, b"").to_wire(), b"extra"),
                                           ({**Vote(1, False, 1, b"").to_wire(), "sig": b"x" * 64}, None)])
async def test_a_malformed_election_message_closes_the_connection(autojump_clock, body, payload):
    async with trio.open_nursery() as nursery:
        s = Swarm(3, seed=7)
        await s.start(nursery)
        await elect(s, 0)
        rogue = s.net.add(b"\x07" * 32)
        await nursery.start(rogue.serve)
        conn = await rogue.connect(*s.transports[1].listen_address)
        await conn.send(ControlMsg.ELECTION, Vote(1, False, 1, b"").to_wire())  # well formed: ignored
        await trio.sleep(0.1)
        assert not conn.closed
        await conn.send(ControlMsg.ELECTION, body, payload=payload)
        await until(lambda: conn.closed, 1.0)
        assert "protocol error" in conn.close_reason
        await trio.sleep(1.0)
        assert s.agreed() == 0 and s.services[1].term == 1
        nursery.cancel_scope.cancel()


async def test_a_refused_input_is_logged_and_the_service_goes_on(autojump_clock, monkeypatch, caplog):
    """An input the machine raises on, or one that would persist what the store refuses, is
    refused: nothing of it leaves, the machine is back at the queued (term, vote), the daemon runs."""
    async with trio.open_nursery() as nursery:
        s = Swarm(3, seed=9)
        await s.start(nursery)
        term = await elect(s, 0)
        victim = s.ids[1]
        real = ElectionState.campaign

        def bad_campaign(self, now):
            if self.me != victim:
                return real(self, now)
            self.term = MAX_TERM + 1  # what a bug in the machine might do
            return [Persist(MAX_TERM + 1, None), ElectionSend(s.ids[0], PreVote(MAX_TERM, victim, 0, 0))]

        def raising_campaign(self, now):
            raise RuntimeError("a bug in the election machine")

        t0 = trio.current_time()
        for patched, words in ((bad_campaign, "would persist term must be"), (raising_campaign, "raised")):
            monkeypatch.setattr(ElectionState, "campaign", patched)
            s.services[1].campaign()
            await trio.sleep(1.0)
            assert any(words in r.getMessage() for r in caplog.records), words
        assert not [m for t, k, _, m in s.sent if k == 1 and t >= t0 and isinstance(m, PreVote)]
        assert s.services[1].term == term and s.stores[1].term == term and 1 not in s.failures
        assert s.agreed() == 0
        nursery.cancel_scope.cancel()


async def test_at_the_largest_term_a_peer_does_not_stand_and_says_so(autojump_clock, caplog):
    async with trio.open_nursery() as nursery:
        s = Swarm(3, seed=10)
        s.stores[1].term = MAX_TERM
        await s.start(nursery)
        s.set_voters()
        svc = s.services[1]
        assert svc.status()["term_exhausted"] is True and svc.term == MAX_TERM
        svc.campaign()
        await trio.sleep(5 * CFG.election_timeout_max_s)  # its own timer fires too
        assert not [m for _, k, _, m in s.sent if k == 1 and isinstance(m, (PreVote, RequestVote))]
        assert svc.role == "follower" and 1 not in s.failures
        assert any("largest" in r.getMessage() for r in caplog.records)
        nursery.cancel_scope.cancel()


async def test_peers_outside_the_configuration_find_the_coordinator_by_asking(autojump_clock):
    # 0..2 elect 0 among themselves; 3 (a joiner: no council) and 4 (restarted with the
    # council 0, 1, 2, 4 that the others left for one without it) hear no heartbeat. Asked, the voters pass on
    # the coordinator's certificate: 4 checks it against its own council and follows 0 (and
    # stops standing); 3 has no council to check it against: it takes nothing from it (it
    # follows once an allocation whose council follows from the operator's root reaches it).
    # Without an operator's request, the background finder gets there within a few rounds.
    async with trio.open_nursery() as nursery:
        s = Swarm(5, seed=3, finder=True)
        await s.start(nursery)
        for k in range(3):
            s.services[k].set_voters(s.ids[:3])
        s.services[4].set_voters(s.ids[:3] + [s.ids[4]])
        s.services[0].campaign()
        assert await s.services[0].wait_until_coordinator(1.0)
        t0 = trio.current_time()
        found = await s.services[3].find_coordinator(s.ids[:3], 1.0)
        assert (found.coordinator, found.configured) == (None, 3) and "3 of the 3 peers asked answered" in found.why
        assert trio.current_time() - t0 < 0.1  # a round trip
        # (outside the configuration without a council: the coordinator is only heard of)
        assert s.services[3].status()["heard_of"] == s.ids[0].hex() and s.services[3].coordinator is None
        learned = await until(lambda: s.services[4].coordinator == s.ids[0], 2 * 5 * CFG.election_timeout_max_s)
        assert [m for t, k, _, m in s.sent if k == 4 and isinstance(m, PreVote)]  # it stood, unanswered
        await trio.sleep(10 * CFG.election_timeout_max_s)
        assert s.services[4].coordinator == s.ids[0] and s.services[4].role == "follower"
        assert s.services[3].role == "follower" and s.agreed(range(3)) == 0
        assert not [m for t, k, _, m in s.sent if k == 4 and isinstance(m, PreVote) and t > learned]
        # the voters of 0's term: none is ever asked to vote again
        assert [e for e in s.became() if e[2] > 1] == []
        nursery.cancel_scope.cancel()
