"""Outgoing frame scheduling: the LinkShaper hook and the default priority queue.

A connection sends every plaintext frame through a `LinkShape`: `submit()` queues it and
`run(transmit)` calls `transmit(frame)` (encrypt and write) when the frame should leave. Frames
a shape drops never consume a nonce. Test swarms plug in a shaper that emulates latency,
bandwidth and loss between regions; without one, `PriorityShape` sends control frames ahead
of payload chunks, so a ping waits for at most one chunk of a large transfer.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from .frames import ABORT, CHUNK, OutFrame

logger = logging.getLogger(__name__)

Transmit = Callable[[OutFrame], Awaitable[None]]


class LinkShape(Protocol):
    async def run(self, transmit: Transmit) -> None:
        """Started in the connection's nursery; loops forever delivering queued frames."""

    async def submit(self, frame: OutFrame, droppable: bool) -> None:
        """Queue a frame (may apply backpressure); may drop it if droppable. CHUNK and ABORT
        frames must leave in the order they were submitted."""


class LinkShaper(Protocol):
    def open_link(self, peer_id: bytes, region: str) -> LinkShape: ...


class PriorityShape:
    """Two bounded FIFO queues, control frames first, payload chunks when none are waiting.

    An ABORT frame travels in the chunk queue, behind the chunks of its payload sent before it.

    A full control queue drops droppable frames (logged) and makes others wait.
    """

    def __init__(self, max_control_frames: int = 256, max_chunk_frames: int = 2) -> None:
        self._control: deque[OutFrame] = deque()
        self._chunks: deque[OutFrame] = deque()
        self._max = {False: max_control_frames, True: max_chunk_frames}
        self._not_empty = trio.lowlevel.ParkingLot()
        self._not_full = trio.lowlevel.ParkingLot()
        self.dropped = 0

    async def submit(self, frame: OutFrame, droppable: bool) -> None:
        is_chunk = frame[0] in (CHUNK, ABORT)
        q = self._chunks if is_chunk else self._control
        if len(q) >= self._max[is_chunk]:
            if droppable and not is_chunk:
                self.dropped += 1
                logger.warning("send queue full: dropped a droppable frame")
                return
            while len(q) >= self._max[is_chunk]:
                await self._not_full.park()
        q.append(frame)
        self._not_empty.unpark_all()

    async def run(self, transmit: Transmit) -> None:
        while True:
            if self._control:
                frame = self._control.popleft()
            elif self._chunks:
                frame = self._chunks.popleft()
            else:
                await self._not_empty.park()
                continue
            self._not_full.unpark_all()
            await transmit(frame)
