"""The failure-detection figures of docs/gossip.md, deterministic under the discrete-event
simulator (memberlist LAN defaults: 1 s probes, suspicion 4 x log10(N) probe intervals)."""

import pytest

from dtfm.gossip.config import GossipConfig
from dtfm.gossip.members import MemberState
from dtfm.gossip.simulator import SwimSimulator

LAN = GossipConfig.lan()


def converged(s):
    n = len(s.live())
    return all(s.nodes[k].live_count() == n for k in s.live())


@pytest.mark.parametrize("seed", [1, 2])
def test_killed_peer_marked_dead_by_everyone_within_bound(seed):
    s = SwimSimulator(16, LAN, seed=seed, drop_fraction=0.05)
    s.run_until(10.0)
    assert converged(s)
    s.kill(3)
    bound = LAN.suspicion_max_s(16) + 3 * LAN.probe_interval_s
    s.run_until(10.0 + bound)
    for k in s.live():
        t = s.first_time(k, 3, MemberState.DEAD)
        assert t is not None, f"member {k} never marked the killed peer dead"
        assert t - 10.0 <= bound
    # and nobody else died
    assert all(s.state_seen(k, j) == MemberState.ALIVE for k in s.live() for j in s.live())


def assert_no_false_deaths(horizon_s):
    """One peer stalls for twice the probe timeout every 10 s over horizon_s, 10% of frames
    dropped: the stalls are suspected, and refuted every time."""
    s = SwimSimulator(16, LAN, seed=7, drop_fraction=0.10, codec=False)
    s.run_until(30.0)  # (a member whose verification pings were all lost waits for its probe)
    assert converged(s)
    stall = 2 * LAN.probe_timeout_s
    while s.now < 30.0 + horizon_s:
        s.stall(5, stall)
        s.run_until(s.now + 10.0)
    suspicions = sum(1 for h in s.history.values() for _, st in h if st == MemberState.SUSPECT)
    assert suspicions > 0  # the stalls were noticed ...
    deaths = [(k, j) for (k, j), h in s.history.items() if any(st == MemberState.DEAD for _, st in h)]
    assert deaths == []  # ... and refuted every time
    assert converged(s)


def test_no_false_deaths_over_ten_minutes_with_stalls_and_drops():
    # (60 stalls and over 1,500 suspicions, each refuted; the hour is the soak below)
    assert_no_false_deaths(600.0)


@pytest.mark.soak
def test_no_false_deaths_over_an_hour_with_stalls_and_drops():
    assert_no_false_deaths(3600.0)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_leave_reaches_all_16_within_15_gossip_intervals(seed):
    s = SwimSimulator(16, LAN, seed=seed, drop_fraction=0.05)
    s.run_until(10.0)
    s.leave(7)
    s.run_until(10.0 + 15 * LAN.gossip_interval_s)
    for k in range(16):
        if k != 7:
            assert s.state_seen(k, 7) == MemberState.LEFT, f"member {k} missed the leave"


def test_refutation_reaches_all_16_within_15_gossip_intervals():
    s = SwimSimulator(16, LAN, seed=5)
    s.run_until(10.0)
    s.stall(2, 3.0)  # long enough to be suspected, short enough to refute
    s.run_until(13.0)
    t_back = s.now
    s.run_until(t_back + 15 * LAN.gossip_interval_s + LAN.probe_interval_s)
    inc = s.nodes[2].me.incarnation
    assert inc >= 1
    assert all(s.nodes[k].members[s.ids[2]].incarnation == inc for k in range(16))
    assert all(s.state_seen(k, 2) == MemberState.ALIVE for k in range(16))


def test_messages_per_member_grow_at_most_15_percent_per_doubling():
    rates = {}
    for n in (8, 16, 32, 64):
        s = SwimSimulator(n, LAN, seed=1, codec=False)
        s.run_until(30.0)
        f0 = sum(s.frames)
        s.leave(n - 1)  # one membership change in the window
        s.run_until(90.0)
        rates[n] = (sum(s.frames) - f0) / n / 60.0
    for small, big in [(8, 16), (16, 32), (32, 64)]:
        assert rates[big] <= 1.15 * rates[small], rates
