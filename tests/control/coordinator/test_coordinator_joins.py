"""JoinWave (control/coordinator/joins.py): joined peers taken in together."""

import math

import pytest

from dtfm.control.coordinator.joins import JoinWave

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def test_a_wave_is_due_once_no_peer_joined_for_the_settle_time():
    w = JoinWave(settle_s=10.0, max_wait_s=60.0)
    assert not w.due([], 0.0) and w.wait_s(0.0) == math.inf
    assert not w.due([A], 1.0) and w.wait_s(1.0) == 10.0
    assert not w.due([A, B], 8.0) and w.wait_s(9.0) == 9.0  # B restarts the quiet time
    assert not w.due([A, B], 17.9)
    assert w.due([A, B], 18.0) and len(w) == 2
    w.clear()
    assert len(w) == 0 and not w.due([], 19.0)


def test_a_steady_trickle_of_joins_is_taken_in_after_the_longest_wait():
    w = JoinWave(settle_s=10.0, max_wait_s=30.0)
    peers = [bytes([i]) * 32 for i in range(10)]
    due = [t for t in range(40) if w.due(peers[: 1 + t // 5], float(t))]  # a joiner every 5 s
    assert due and due[0] == 30


def test_a_joiner_that_goes_away_leaves_the_wave():
    w = JoinWave(settle_s=5.0, max_wait_s=20.0)
    w.due([A], 0.0)
    w.due([A, C], 3.0)
    assert not w.due([C], 6.0) and len(w) == 1  # A gone; C's wave settles at 8
    assert w.due([C], 8.0)


def test_settle_must_not_exceed_the_longest_wait():
    with pytest.raises(ValueError):
        JoinWave(settle_s=10.0, max_wait_s=5.0)
