"""How late the daemon's event loop runs, and what held it when it stalled.

Every timer of the daemon (gossip probes, election heartbeats and leases, request timeouts)
assumes the event loop wakes when asked. Work that holds the loop's thread (a large copy, a hash,
a decode, the GIL held by another thread) delays all of them at once, and the symptoms show up
far away: a coordinator steps down for want of acks, a peer is suspected, a request times out.

`LoopWatch` runs two parts:

- a trio task that sleeps `tick_s` again and again and records how late each wake-up was
  (`LoopLateness`: the worst of the last minute, the worst ever, the count of stalls);
- a watchdog thread that looks at the task's last beat every `stall_s` / 2; when the loop has
  not beaten for `stall_s`, it takes the loop thread's Python stack once (the frame that holds the
  loop), and the task logs it with the stall's length once the loop runs again (at most one
  stall every STALL_LOG_INTERVAL_S, `dtfm.net.LogLimiter`, saying how many were left out; status
  counts every one).

Ten wake-ups a second of the task and eight of the watchdog: an idle daemon's loop watch costs
about 0.002 of a core (`bench/idle.py`: 0.016-0.017 cores per idle daemon with it, 0.018-0.021
with the task at 20 and the watchdog at 20 a second).

The bookkeeping is sans-IO (`LoopLateness`, `StallSnapshot`), tested with numbers; the thread
and the task are thin.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from dtfm.net import LogLimiter

__all__ = ["LoopLateness", "LoopWatch", "StallSnapshot", "stack_of_thread"]

logger = logging.getLogger(__name__)

WINDOW_S = 60.0  # the "recent" worst lateness covers this long
STALL_LOG_INTERVAL_S = 10.0  # at most one stall logged this often (the others counted in it)
MAX_FRAMES = 8   # innermost frames kept of a stalled loop's stack


def stack_of_thread(ident: int, max_frames: int = MAX_FRAMES) -> list[str]:
    """The innermost `max_frames` frames of thread `ident`'s Python stack, innermost last, as
    "file:line function" (empty if the thread is gone)."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return []
    summary = traceback.extract_stack(frame)[-max_frames:]
    return [f"{_short_path(f.filename)}:{f.lineno} {f.name}" for f in summary]


# the dtfm package's folder, whatever its name (an editable install's is the repository)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _short_path(path: str) -> str:
    """This package's files as dtfm/..., others by their last two parts."""
    full = os.path.realpath(path)
    if full.startswith(_PACKAGE_ROOT + os.sep):
        return "dtfm/" + os.path.relpath(full, _PACKAGE_ROOT).replace(os.sep, "/")
    return "/".join(path.replace("\\", "/").split("/")[-2:])


@dataclass(frozen=True)
class StallSnapshot:
    """The loop's stack, taken by the watchdog while the loop had not beaten for `quiet_s`."""

    quiet_s: float
    stack: tuple[str, ...]


class LoopLateness:
    """The lateness of the loop's wake-ups: the worst within the last `window_s`, the worst
    ever, how many were stalls (late by `stall_s` or more), and the last stall's length and
    stack. Fed by `woke(now, late_s)`; `now` is any monotonic clock."""

    def __init__(self, stall_s: float, window_s: float = WINDOW_S):
        if not stall_s > 0 or not window_s > 0:
            raise ValueError("stall_s and window_s must be positive")
        self.stall_s = stall_s
        self.window_s = window_s
        self.worst_s = 0.0
        self.stalls = 0
        self.wakes = 0
        self.last_stall: dict[str, Any] | None = None
        # (time, lateness), lateness decreasing along the deque: a monotonic queue of the window's maxima
        self._recent: deque[tuple[float, float]] = deque()

    def woke(self, now: float, late_s: float, snapshot: StallSnapshot | None = None,
             wall: float | None = None) -> bool:
        """Record one wake-up `late_s` after it was due; True when it was a stall."""
        late_s = max(0.0, late_s)
        self.wakes += 1
        self.worst_s = max(self.worst_s, late_s)
        while self._recent and self._recent[-1][1] <= late_s:
            self._recent.pop()
        self._recent.append((now, late_s))
        self._expire(now)
        if late_s < self.stall_s:
            return False
        self.stalls += 1
        self.last_stall = {"late_s": round(late_s, 3), "at": wall,
                           "stack": list(snapshot.stack) if snapshot is not None else []}
        return True

    def recent_worst_s(self, now: float) -> float:
        self._expire(now)
        return self._recent[0][1] if self._recent else 0.0

    def _expire(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def status(self, now: float) -> dict[str, Any]:
        return {"late_ms_worst_1m": round(1000 * self.recent_worst_s(now), 1),
                "late_ms_worst": round(1000 * self.worst_s, 1), "stalls": self.stalls,
                "stall_ms": round(1000 * self.stall_s), "last_stall": self.last_stall}


class LoopWatch:
    """The trio task (`run`) and its watchdog thread; `status()` for the daemon's report.

    Real time (`time.monotonic`), not trio's clock: the point is the thread's real delays, and a
    test's mock clock would hide them."""

    def __init__(self, *, tick_s: float = 0.1, stall_s: float = 0.25,
                 log_interval_s: float = STALL_LOG_INTERVAL_S, wall: Callable[[], float] = time.time):
        if not 0 < tick_s < stall_s:
            raise ValueError("need 0 < tick_s < stall_s")
        self.tick_s = tick_s
        self.lateness = LoopLateness(stall_s)
        self._wall = wall  # the stalls' timestamps in status
        self._log_limit = LogLimiter(log_interval_s, burst=1, max_keys=1)  # a starved machine stalls often
        self._beat = time.monotonic()
        self._snapshot: StallSnapshot | None = None  # written by the watchdog, taken by the task
        self._lock = threading.Lock()
        self._loop_ident: int | None = None

    def status(self) -> dict[str, Any]:
        return self.lateness.status(time.monotonic())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._loop_ident = threading.get_ident()
        stop = threading.Event()
        watchdog = threading.Thread(target=self._watch, args=(stop,), name="dtfm-loopwatch", daemon=True)
        self._beat = time.monotonic()
        watchdog.start()
        task_status.started()
        try:
            while True:
                due = time.monotonic() + self.tick_s
                await trio.sleep(self.tick_s)
                now = time.monotonic()
                with self._lock:
                    self._beat = now
                    snapshot, self._snapshot = self._snapshot, None
                if self.lateness.woke(now, now - due, snapshot, self._wall()):
                    left_out = self._log_limit.admit("stall", now)
                    if left_out is not None:
                        where = " <- ".join(reversed(snapshot.stack)) if snapshot is not None else "(no stack taken)"
                        more = f"; {left_out} more since the last one logged" if left_out else ""
                        logger.warning("event loop stalled %.2f s (stall %d%s); it was in: %s",
                                       now - due, self.lateness.stalls, more, where)
        finally:
            stop.set()

    def _watch(self, stop: threading.Event) -> None:
        """The watchdog: one stack per stall, taken once the loop has been quiet for stall_s."""
        taken_for = -1.0
        while not stop.wait(self.lateness.stall_s / 2):  # (a stall lasts at least stall_s: seen within half)
            now = time.monotonic()
            with self._lock:
                beat = self._beat
            if now - beat < self.lateness.stall_s or beat == taken_for or self._loop_ident is None:
                continue
            stack = stack_of_thread(self._loop_ident)
            with self._lock:
                if self._beat == beat:  # still the same stall
                    self._snapshot = StallSnapshot(round(now - beat, 3), tuple(stack))
            taken_for = beat
