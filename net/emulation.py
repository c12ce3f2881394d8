"""Link emulation inside the transport: a real delay line and a real rate limiter per link,
with the one-way delay and bandwidth of a scenario file, loss and cut links.

`EmulatedLinks` implements `dtfm.net.shaping.LinkShaper`: a connection, once it knows the
peer's region, opens a `EmulatedLink` and sends every outgoing plaintext frame through it.
Each frame first passes a token bucket at the link's bandwidth (the sender waits when the
queue is full: backpressure, as a socket buffer gives), then sits in the delay line until its
departure time plus the one-way delay, then is transmitted. Dropped frames never reach
`transmit`, so they consume no nonce.

Scales: `time_scale` > 1 stretches time (delays x time_scale, bandwidth / time_scale), so a
small model on a laptop sees the communication-to-compute ratio of a big one on fast GPUs;
`bandwidth_scale` multiplies bandwidth alone. Measured figures divide both back out
(`NetworkView.unscaled`).

Cuts and the drop fraction change at run time and apply to links already open. A shaper sees
only what its own peer sends: cutting a link in both directions means cutting it at both ends
(`dtfm-swarm partition` tells both peers); cutting it at one end cuts one direction.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from .config import EmulationConfig
from .frames import OutFrame
from .shaping import Transmit

if TYPE_CHECKING:
    from dtfm.scenarios import Scenario

__all__ = ["EmulationConfig", "EmulatedLinks", "EmulatedLink"]

logger = logging.getLogger(__name__)

WIRE_OVERHEAD_BYTES = 20  # length prefix + AEAD tag the transport adds to each frame


class _Bucket:
    """Token bucket as a departure clock: a frame of s bytes leaves when the bucket has had
    time to refill s bytes' worth; at most `burst` bytes of credit accumulate."""

    def __init__(self, rate_bytes_s: float, burst_bytes: int) -> None:
        self.rate = rate_bytes_s
        self.burst = burst_bytes
        self.free_at = -math.inf

    def departure(self, size: int, now: float) -> float:
        if not math.isfinite(self.rate):
            return now
        credit_s = self.burst / self.rate
        self.free_at = max(self.free_at, now - credit_s) + size / self.rate
        return max(now, self.free_at)


class EmulatedLinks:
    """The LinkShaper of one peer: links to other peers shaped by `scenario`."""

    def __init__(self, scenario: Scenario, region: str, config: EmulationConfig | None = None, *,
                 rng: random.Random | None = None) -> None:
        self.scenario = scenario
        self.region = region
        self.config = config or EmulationConfig()
        self.drop_fraction = self.config.drop_fraction
        self._rng = rng or random.Random()
        self._cut_peers: set[bytes] = set()
        self._cut_regions: set[str] = set()
        self._region_buckets: dict[str, _Bucket] = {}
        self.links: dict[bytes, EmulatedLink] = {}
        scenario.region(region)  # KeyError: our region is not in the scenario

    # runtime controls

    def set_drop_fraction(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"drop fraction must be in [0, 1], got {fraction}")
        self.drop_fraction = fraction

    def cut(self, *, peer_id: bytes | None = None, region: str | None = None) -> None:
        """Drop everything this peer sends to peer_id / to every peer of region."""
        if peer_id is not None:
            self._cut_peers.add(peer_id)
        if region is not None:
            self._cut_regions.add(region)

    def heal(self, *, peer_id: bytes | None = None, region: str | None = None) -> None:
        """Undo a cut (both None: undo all cuts)."""
        if peer_id is None and region is None:
            self._cut_peers.clear()
            self._cut_regions.clear()
        if peer_id is not None:
            self._cut_peers.discard(peer_id)
        if region is not None:
            self._cut_regions.discard(region)

    @property
    def cut_peers(self) -> frozenset[bytes]:
        return frozenset(self._cut_peers)

    def is_cut(self, peer_id: bytes, region: str) -> bool:
        return peer_id in self._cut_peers or region in self._cut_regions

    def link_figures(self, region: str) -> tuple[float, float]:
        """(one-way delay s, rate bytes/s) of a link to a peer of `region`, scales applied."""
        try:
            delay_ms, gbps = self.scenario.link(self.region, region)
        except KeyError:
            logger.warning("region %r is not in scenario %s: link not shaped", region, self.scenario.name)
            return 0.0, math.inf
        c = self.config
        return delay_ms / 1000.0 * c.time_scale, gbps * 1e9 / 8 * c.bandwidth_scale / c.time_scale

    # LinkShaper

    def open_link(self, peer_id: bytes, region: str) -> "EmulatedLink":
        delay_s, rate = self.link_figures(region)
        if self.config.share_region_bandwidth:
            bucket = self._region_buckets.setdefault(region, _Bucket(rate, self.config.burst_bytes))
        else:
            bucket = _Bucket(rate, self.config.burst_bytes)
        link = EmulatedLink(self, peer_id, region, delay_s, bucket)
        self.links[peer_id] = link
        return link


class EmulatedLink:
    """One shaped link (a LinkShape): each frame is stamped, when queued, with its departure
    from the token bucket plus the one-way delay; `run` transmits frames at their stamps, in
    order, several in flight at once as on a real pipe."""

    def __init__(self, owner: EmulatedLinks, peer_id: bytes, region: str, delay_s: float,
                 bucket: _Bucket) -> None:
        self._owner = owner
        self.peer_id = peer_id
        self.region = region
        self.delay_s = delay_s
        self._bucket = bucket
        self._slots = trio.Semaphore(owner.config.queue_frames)
        self._send, self._recv = trio.open_memory_channel[tuple[float, OutFrame]](math.inf)  # bounded by _slots
        self.dropped = 0
        self.sent = 0

    async def submit(self, frame: OutFrame, droppable: bool) -> None:
        owner = self._owner
        if owner.is_cut(self.peer_id, self.region) or (
                droppable and owner.drop_fraction > 0 and owner._rng.random() < owner.drop_fraction):
            self.dropped += 1
            await trio.lowlevel.checkpoint()
            return
        await self._slots.acquire()  # backpressure: the queue is full
        departs = self._bucket.departure(len(frame) + WIRE_OVERHEAD_BYTES, trio.current_time())
        self._send.send_nowait((departs + self.delay_s, frame))

    async def run(self, transmit: Transmit) -> None:
        async for due, frame in self._recv:
            await trio.sleep_until(due)
            self._slots.release()
            if self._owner.is_cut(self.peer_id, self.region):  # cut while in flight
                self.dropped += 1
                continue
            await transmit(frame)
            self.sent += 1
