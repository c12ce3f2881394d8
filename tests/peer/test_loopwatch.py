"""The event loop's lateness and the stack that held it (peer/loopwatch.py)."""

from __future__ import annotations

import logging
import time

import pytest
import trio

from dtfm.peer.loopwatch import LoopLateness, LoopWatch, StallSnapshot, stack_of_thread
from dtfm.peer.metrics import metrics_registry
from dtfm.peer.status import format_loop


def test_lateness_keeps_the_worst_of_the_window_and_counts_stalls():
    late = LoopLateness(stall_s=0.25, window_s=60.0)
    assert not late.woke(0.0, 0.01)
    assert not late.woke(1.0, 0.2)
    assert late.recent_worst_s(1.0) == 0.2
    snap = StallSnapshot(0.3, ("dtfm/train/transfer.py:157 feed", "dtfm/control/epoch/recovery.py:496 _one_chunk"))
    assert late.woke(2.0, 0.7, snap, wall=1_700_000_000.0)
    assert not late.woke(3.0, 0.05)
    assert late.recent_worst_s(3.0) == 0.7
    assert late.stalls == 1 and late.wakes == 4
    assert late.last_stall == {"late_s": 0.7, "at": 1_700_000_000.0, "stack": list(snap.stack)}
    # a minute after the stall the window forgets it, the worst ever does not
    assert late.recent_worst_s(62.5) == 0.05
    assert late.recent_worst_s(63.5) == 0.0
    st = late.status(63.5)
    assert st["late_ms_worst"] == 700.0 and st["late_ms_worst_1m"] == 0.0 and st["stalls"] == 1
    assert late.woke(64.0, 0.25)  # at the threshold: a stall, without a stack when none was taken
    assert late.last_stall["stack"] == [] and late.stalls == 2
    assert not late.woke(65.0, -0.01)  # early (a coarse clock): counted as on time
    with pytest.raises(ValueError):
        LoopLateness(stall_s=0)


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a large copy or hash in the event loop's thread does


async def _stall_once(watch: LoopWatch, seconds: float) -> None:
    """Hold the loop `seconds` and wait (5 s at most) until the watch counted one more stall."""
    before = watch.status()["stalls"]
    _hold_the_loop(seconds)
    with trio.fail_after(5):
        while watch.status()["stalls"] == before:
            await trio.sleep(0.02)


async def test_a_stall_is_counted_with_the_stack_that_held_the_loop(caplog):
    """Real time, bounded: the loop is held 0.3 s by a blocking call; the watch counts the stall
    and names the function that held it, in its status and in a warning. (A loaded machine may
    add stalls of its own: the test looks for this one among them, every stall logged.)"""
    watch = LoopWatch(tick_s=0.02, stall_s=0.1, log_interval_s=1e-3, wall=lambda: 1_700_000_000.0)
    caplog.set_level(logging.WARNING, logger="dtfm.peer.loopwatch")
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        await trio.sleep(0.05)
        await _stall_once(watch, 0.3)
        nursery.cancel_scope.cancel()
    st = watch.status()
    assert st["late_ms_worst"] >= 250 and st["last_stall"]["at"] == 1_700_000_000.0
    held = [r.message for r in caplog.records if "_hold_the_loop" in r.message]
    assert held and held[0].startswith("event loop stalled 0.")
    assert "dtfm/tests/peer/test_loopwatch.py:" in held[0]  # this package's files named from its root


async def test_stalls_are_logged_once_an_interval_and_all_counted(caplog):
    """A starved machine stalls the loop again and again: one warning per interval, each stall
    counted in status. Real time, bounded: two holds of 0.2 s, a 60 s interval."""
    watch = LoopWatch(tick_s=0.02, stall_s=0.1, log_interval_s=60.0)
    caplog.set_level(logging.WARNING, logger="dtfm.peer.loopwatch")
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        for _ in range(2):
            await _stall_once(watch, 0.2)
        nursery.cancel_scope.cancel()
    assert watch.status()["stalls"] >= 2
    assert len([r for r in caplog.records if "event loop stalled" in r.message]) == 1


def test_settings_are_checked():
    with pytest.raises(ValueError):
        LoopWatch(tick_s=0.3, stall_s=0.25)


def test_a_thread_that_is_gone_has_no_stack():
    assert stack_of_thread(-1) == []


def test_the_loop_in_words_and_as_metrics():
    assert format_loop(None) == ""
    quiet = {"late_ms_worst_1m": 3.2, "late_ms_worst": 40.0, "stalls": 0, "stall_ms": 250, "last_stall": None}
    assert format_loop(quiet) == "late by 3.2 ms at worst in the last minute"
    stalled = dict(quiet, stalls=2, last_stall={"late_s": 0.61, "at": 0.0, "stack": [
        "dtfm/train/transfer.py:157 feed", "hashlib.py:1 sha256"]})
    assert format_loop(stalled) == ("late by 3.2 ms at worst in the last minute; 2 stalls of 250 ms or more, "
                                    "the last 0.61 s in dtfm/train/transfer.py:157 feed at 00:00:00 UTC")
    snap = {"loop": stalled}
    got = {s.name: s.value for f in metrics_registry(lambda: snap).collect() for s in f.samples}
    assert got["dtfm_event_loop_late_seconds"] == pytest.approx(0.0032)
    assert got["dtfm_event_loop_stalls_total"] == 2
