"""GossipService: runs membership, measurement and record anti-entropy over a Transport.

    service = GossipService(transport, identity, GossipConfig.lan(), region="Oregon")
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        await service.join([("10.0.0.2", 7000)])

The transport is any `dtfm.net.PeerTransport`: the TCP `Transport` in the daemon, the in-memory
`MemTransport` in tests and the harness. The decisions are the sans-IO machines' (`Swim`, `RecordSyncer`,
`MeasurePlanner`); this class feeds them messages and time and does what they return.

Each report carries this peer's compute speed (`compute_ms`) and its coding speed (`codec_ns`,
an opaque vector: records.py): each given, or measured once at start by a blocking probe run
in a worker thread (`compute_speed_ms`, and the `codec_probe` the daemon passes).
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import trio

from dtfm.net import ConnectionClosed, PeerConnection, PeerTransport, ProtocolError, RemoteError, RequestTimeout

from .claims import ClaimVerifier
from .config import GossipConfig
from .measure import (
    BulkGate,
    JobKind,
    MeasureJob,
    MeasureLinks,
    MeasurePing,
    MeasurePlanner,
    compute_speed_ms,
    measure_bandwidth,
    measure_download,
    measure_rtt,
    report_due,
    serve_bulk,
    serve_ping,
)
from .members import Member, MemberState
from .messages import MsgType, decode_swim
from .records import MAX_COMPUTE_MS, VERIFY_SLICE, RecordStore, Report, check_codec_ns, check_host
from .status import gossip_status
from .swim import Send, Swim
from .sync import RecordSync, RecordSyncer
from .view import NetworkView, build_view
from .vivaldi import Coordinate, Vivaldi

if TYPE_CHECKING:
    from dtfm.net import Identity

__all__ = ["GossipService", "offer_all"]

logger = logging.getLogger(__name__)

_SWIM_TYPES = (MsgType.PING, MsgType.ACK, MsgType.PING_REQ, MsgType.NACK, MsgType.GOSSIP,
               MsgType.PUSH_PULL)
# What connect() raises when the peer cannot be reached or refuses us (a HandshakeError is a
# ProtocolError, a TimeoutError an OSError). Anything else is a bug and propagates.
_CONNECT_ERRORS = (ConnectionClosed, ProtocolError, OSError)
# A compute figure measured in training goes out in a new report when it moved by more than this
# from the reported one (steps vary by a few percent; a report every step would be noise).
COMPUTE_REPUBLISH_RATIO = 1.15


async def offer_all(store: RecordStore, reports: Sequence[Report], *, now_wall: float,
                    is_member: Callable[[bytes], bool], slice_size: int = VERIFY_SLICE) -> list[str | None]:
    """Offer each report to `store` (`RecordStore.offer_slices`), yielding to the other tasks
    after every `slice_size` signature verifications; the reasons, one per report."""
    slices = store.offer_slices(reports, now_wall=now_wall, is_member=is_member, slice_size=slice_size)
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value
        await trio.lowlevel.checkpoint()


@dataclass(frozen=True)
class _SyncSend:
    """A record sync to send, queued with Swim's sends (`Send`'s fields, for another message)."""

    to: bytes
    address: tuple[str, int] | None
    msg: RecordSync
    dial: bool = False


class GossipService:
    def __init__(self, transport: PeerTransport, identity: Identity, config: GossipConfig | None = None, *,
                 region: str = "", rng: random.Random | None = None,
                 wall_clock: Callable[[], float] = time.time, compute_ms: float | None = None,
                 measure: bool = True, sender_tasks: int = 4,
                 address: tuple[str, int] | None = None, verifier: ClaimVerifier | None = None,
                 codec_ns: Sequence[float] | None = None,
                 codec_probe: Callable[[], Sequence[float]] | None = None,
                 compute_probe: Callable[[], float] = compute_speed_ms, machine: bytes = b"") -> None:
        """compute_ms: this peer's compute speed, None to measure it with `compute_probe`
        once in a worker thread at start (when `measure`; a failed probe leaves it unknown).
        codec_ns: this peer's coding speed (`check_codec_ns`; ValueError otherwise), or None
        to run `codec_probe` once in a worker thread at start (no probe: reported unknown).
        machine: the machine's fingerprint its reports carry as `host` (`host_fingerprint`; b"": none)."""
        self.transport = transport
        self.identity = identity
        self.config = config or GossipConfig.lan()
        self.region = region
        # Verification nonces must be unguessable by peers: from the OS unless the caller
        # seeds everything (tests, the harness).
        nonces = random.SystemRandom() if rng is None else rng
        self._rng = rng or random.Random()
        self._wall = wall_clock
        self.compute_ms = compute_ms
        self.compute_share = 0.0  # the share of a core `compute_ms` was measured with (0: unknown)
        try:
            self.machine = check_host(machine)
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        try:
            self.codec_ns: tuple[float, ...] | None = None if codec_ns is None else check_codec_ns(tuple(codec_ns))
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        self._codec_probe = codec_probe
        self._compute_probe = compute_probe
        self._measure = measure
        self._sender_tasks = sender_tasks
        # The address other members dial: the transport's (serve() must have started), or
        # the one given when it listens on a wildcard address.
        host, port = address or transport.listen_address
        me = Member(identity.peer_id, 0, MemberState.ALIVE, host, port, region)
        self.swim = Swim(self.config, identity, me, self._rng, trio.current_time(), verifier=verifier,
                         nonces=nonces)
        self.records = RecordStore(self.config.record_skew_s)
        self.sync = RecordSyncer(self.records, max_sync_bytes=self.config.max_sync_bytes,
                                 timeout_s=self.config.record_sync_timeout_s)
        cfg = self.config
        self.planner = MeasurePlanner(cfg.remeasure_interval_s, cfg.bandwidth_probe_interval_s,
                                      cfg.measure_jitter, self._rng, full_mesh_max_peers=cfg.full_mesh_max_peers,
                                      capacity_peers=cfg.capacity_peers, coord_interval_s=cfg.coord_interval_s,
                                      confirm_fresh_s=cfg.confirm_fresh_s, max_report_links=cfg.max_report_links)
        self.gate = BulkGate()
        self.vivaldi = Vivaldi(random.Random(self._rng.random()))
        self._rtt_seen: dict[bytes, float] = {}  # the last round trip to each peer sampled, ms (bounded)
        self._seq = 0
        self._published_version = -1
        self._published_at = float("-inf")
        self._published: Report | None = None
        self._wake = trio.Event()  # set when links are asked for: the measurement loop looks again
        self._progress = trio.Event()  # set (and replaced) after each measurement
        self._timer_scope: trio.CancelScope | None = None
        self._out_send, self._out_recv = trio.open_memory_channel[Send | _SyncSend](1024)
        # Sends that need a dial first, served by their own tasks so that a slow or silent
        # address (a fake member's) never holds up the sends over open connections.
        self._dial_send, self._dial_recv = trio.open_memory_channel[Send | _SyncSend](64)
        self._listeners: list[Callable[[Member], None]] = []
        self._view_cache: tuple | None = None
        for t in _SWIM_TYPES:
            transport.handle(t, self._on_swim)
        transport.handle(MsgType.RECORD_SYNC, self._on_sync)
        transport.handle(MsgType.MEASURE_PING, self._on_ping)
        transport.handle(MsgType.MEASURE_BULK, self._on_bulk)
        transport.handle(MsgType.MEASURE_LINKS, self._on_measure_links)

    # ---- public API

    def on_member_change(self, cb: Callable[[Member], None]) -> None:
        """Call cb(member) whenever a member is confirmed (joined) or a confirmed member's
        state changes (suspect, dead, left)."""
        self._listeners.append(cb)

    def keep_members(self, protected: Callable[[bytes], bool]) -> None:
        """Never remove a member for which protected(peer_id) is true to make room in a full
        table (the daemon passes the peers its current allocation names)."""
        self.swim.protected = protected

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self._sender_tasks):
                nursery.start_soon(self._sender)
            for _ in range(self.config.max_verifying):
                nursery.start_soon(self._dialler)
            nursery.start_soon(self._timer_loop)
            nursery.start_soon(self._sync_loop)
            if self._measure:
                nursery.start_soon(self._measure_loop)
            elif self.codec_ns is None and self._codec_probe is not None:
                nursery.start_soon(self._measure_self)
            task_status.started()

    async def join(self, addresses: Iterable[tuple[str, int]], *, timeout_s: float = 10.0) -> int:
        """Contact bootstrap peers and push-pull state with them; how many were reached."""
        reached = 0
        for host, port in addresses:
            with trio.move_on_after(timeout_s):
                try:
                    conn = await self.transport.connect(host, port)
                except _CONNECT_ERRORS as e:
                    # (the caller retries: a peer not started yet is the normal case, not a warning)
                    logger.debug("cannot reach bootstrap peer %s:%d: %s", host, port, e)
                    continue
                if conn.peer_id == self.identity.peer_id:
                    continue
                h, p = conn.listen_address
                if h in ("", "0.0.0.0", "::"):  # it listens on every interface: use the one we reached
                    h = conn.remote_address[0]
                self._dispatch(self.swim.add_seed(conn.peer_id, (h, p), trio.current_time(),
                                                  origin=conn.remote_address[0]))
                reached += 1
        self._after_change()
        return reached

    async def leave(self, *, linger_s: float | None = None) -> None:
        """Announce a graceful leave and give the announcement time to spread."""
        self._dispatch(self.swim.leave(trio.current_time()))
        await trio.sleep(self.config.gossip_interval_s * 3 if linger_s is None else linger_s)

    def set_address(self, host: str, port: int) -> None:
        """Advertise host:port as this member's address from now on (learnt after start, e.g.
        confirmed by peers): a new signed claim one incarnation up, gossiped like a refutation
        and sent at once to the members this peer knows (`Swim.advertise_address`)."""
        self._dispatch(self.swim.advertise_address(host, port, trio.current_time()))

    def members(self) -> list[Member]:
        """Every member in the table, confirmed or not (live_peers: the ones that count)."""
        return sorted(self.swim.members.values(), key=lambda m: m.peer_id)

    def live_peers(self) -> list[bytes]:
        """The members that count as alive: confirmed, neither dead nor left (this peer too)."""
        return sorted(m.peer_id for m in self.swim.live_members())

    def status(self) -> dict:
        """JSON-able status for `dtfm-peer status`, bounded whatever the table holds
        (`gossip_status`): counts by state, the first members, this peer's own measurements,
        and the N x N view (ids in hex, one-way ms and Gbps, null where unknown; measured
        and estimated links counted apart; `full_mesh`: this peer measures every link)."""
        swim = self.swim
        now = trio.current_time()
        ages = {p: now - link.measured_at for p, link in self.planner.links.items()}
        live = self.live_peers()
        out = gossip_status(swim.members.values(), swim.is_confirmed, self.planner.entries(),
                            live, self.records.reports, self.view, me=self.identity.peer_id,
                            measured_s_ago=ages, refused=swim.refused, evicted=swim.evicted)
        out["view"]["full_mesh"] = self.planner.full_mesh(len(live) - 1)  # every link measured, not estimated
        out["compute_ms"] = self.compute_ms  # this peer's compute figure as it reports it (None: unknown)
        out["compute_share"] = self.compute_share or None  # the share of a core it was measured with
        return out

    def view(self) -> NetworkView:
        """The N x N view over the live members, in peer-id order: measured figures where
        either end measured the link, estimated ones elsewhere (`NetworkView.delay_measured`,
        `bandwidth_measured`, `age_s` say which)."""
        peers = tuple(self.live_peers())
        wall = self._wall()
        key = (peers, self.records.version, int(wall // 5))
        if self._view_cache is None or self._view_cache[0] != key:
            self._view_cache = (key, build_view(peers, self.records.reports, now_wall=wall))
        return self._view_cache[1]

    def coordinate(self) -> Coordinate | None:
        """This peer's network coordinate, once it has coord_min_samples samples behind it."""
        if self.vivaldi.samples < self.config.coord_min_samples:
            return None
        return self.vivaldi.coord

    async def confirm(self, links: Iterable[tuple[bytes, bytes]], *,
                      timeout_s: float | None = None) -> list[tuple[bytes, bytes]]:
        """Measure the links (a, b) given, now, from both ends: this peer measures its own,
        and asks each other end (`MeasureLinks`) for its, taking the signed report it answers
        with. The links still not measured (an end gone, or silent past timeout_s) in the view
        after it. Links measured within confirm_fresh_s are not measured again."""
        timeout_s = self.config.confirm_timeout_s if timeout_s is None else timeout_s
        me = self.identity.peer_id
        live = set(self.live_peers())
        asks: dict[bytes, set[bytes]] = {}
        wanted = [(a, b) for a, b in links if a != b and a in live and b in live]
        for a, b in wanted:
            asks.setdefault(a, set()).add(b)
            asks.setdefault(b, set()).add(a)
        limiter = trio.CapacityLimiter(self.config.max_verifying)

        async def ask(peer: bytes, targets: set[bytes]) -> None:
            async with limiter:
                if peer == me:
                    await self._measure_asked(sorted(targets), timeout_s)
                else:
                    await self._ask_peer(peer, sorted(targets), timeout_s)

        async with trio.open_nursery() as nursery:
            for peer, targets in asks.items():
                nursery.start_soon(ask, peer, targets)
        view = build_view(tuple(sorted(live)), self.records.reports, now_wall=self._wall())
        return view.unmeasured(wanted)
    # ---- plumbing

    def _dispatch(self, sends: list[Send]) -> None:
        for s in sends:
            try:
                self._out_send.send_nowait(s)
            except trio.WouldBlock:
                logger.warning("outgoing gossip queue full: dropping a message to %s", s.to[:4].hex())
        if self._timer_scope is not None:
            self._timer_scope.deadline = min(self._timer_scope.deadline, self.swim.next_deadline())

    async def _link(self, peer_id: bytes, address: tuple[str, int] | None) -> PeerConnection | None:
        conn = self.transport.connection(peer_id)
        if conn is None and address is not None:
            with trio.move_on_after(self.config.measure_timeout_s):
                try:
                    conn = await self.transport.connect(*address, peer_id=peer_id)
                except _CONNECT_ERRORS as e:
                    logger.debug("cannot connect to %s at %s: %s", peer_id[:4].hex(), address, e)
                    return None
            if conn is not None and conn.peer_id != peer_id:
                return None
        return conn

    async def _dial(self, address: tuple[str, int], peer_id: bytes) -> PeerConnection | None:
        """A connection whose handshake, on a dial to address, proved peer_id (one dialled
        there before is reused); None if there is none within verify_timeout_s."""
        with trio.move_on_after(self.config.verify_timeout_s):
            try:
                conn = await self.transport.connect(*address)
            except _CONNECT_ERRORS as e:
                logger.debug("cannot verify %s at %s: %s", peer_id[:4].hex(), address, e)
                return None
            if conn.peer_id != peer_id:
                logger.debug("cannot verify %s at %s: peer %s listens there", peer_id[:4].hex(), address,
                             conn.peer_id[:4].hex())
                return None
            return conn
        logger.debug("cannot verify %s at %s: no connection within %g s", peer_id[:4].hex(), address,
                     self.config.verify_timeout_s)
        return None

    async def _sender(self) -> None:
        async for s in self._out_recv:
            conn = None if s.dial else self.transport.connection(s.to)
            if conn is None:
                if s.address is None:
                    continue
                try:
                    self._dial_send.send_nowait(s)
                except trio.WouldBlock:
                    logger.debug("dial queue full: dropping a message to %s", s.to[:4].hex())
                continue
            await self._deliver(conn, s)

    async def _dialler(self) -> None:
        async for s in self._dial_recv:
            if s.dial and s.address is not None:
                conn = await self._dial(s.address, s.to)
            else:
                conn = await self._link(s.to, s.address)
            if conn is not None:
                await self._deliver(conn, s)

    async def _deliver(self, conn: PeerConnection, s: Send | _SyncSend) -> None:
        try:
            await conn.send(s.msg.type, s.msg.to_wire(), droppable=True)
        except ConnectionClosed as e:
            logger.debug("send to %s failed: %s", s.to[:4].hex(), e)

    async def _timer_loop(self) -> None:
        while True:
            with trio.CancelScope(deadline=self.swim.next_deadline()) as scope:
                self._timer_scope = scope
                await trio.sleep_forever()
            self._timer_scope = None
            self._dispatch(self.swim.tick(trio.current_time()))
            self._after_change()

    def _after_change(self) -> None:
        for m in self.swim.drain_changes():
            if m.state.gone:
                self.records.retire(m.peer_id)
                self.planner.forget(m.peer_id)
            for cb in self._listeners:
                cb(m)

    def _is_member(self, peer_id: bytes) -> bool:
        """Whose reports we take: members that count as alive."""
        m = self.swim.members.get(peer_id)
        return m is not None and not m.state.gone and self.swim.is_confirmed(peer_id)

    # ---- handlers

    async def _on_swim(self, conn: PeerConnection, msg_type: int, body: object, payload: memoryview | None) -> None:
        msg = decode_swim(msg_type, body)  # ProtocolError: the transport closes that connection
        self._dispatch(self.swim.handle(conn.peer_id, msg, trio.current_time(),
                                        origin=conn.remote_address[0]))
        self._after_change()
        await trio.lowlevel.checkpoint()
        return None

    async def _on_ping(self, conn: PeerConnection, msg_type: int, body: object, payload: memoryview | None) -> dict:
        return await serve_ping(body, self.vivaldi.coord.to_wire())

    async def _on_measure_links(self, conn: PeerConnection, msg_type: int, body: object,
                                payload: memoryview | None) -> object:
        msg = MeasureLinks.from_wire(body)  # ProtocolError: the transport closes that connection
        if not self._is_member(conn.peer_id):
            return {"ok": False}
        await self._measure_asked(list(msg.targets), self.config.confirm_timeout_s)
        report = self._published
        return {"ok": True, "report": None if report is None else report.to_wire()}

    async def _on_bulk(self, conn: PeerConnection, msg_type: int, body: object, payload: memoryview | None) -> object:
        await trio.lowlevel.checkpoint()
        return serve_bulk(self.gate, conn.peer_id, body, payload, trio.current_time(),
                          self.config.measure_timeout_s)

    async def _on_sync(self, conn: PeerConnection, msg_type: int, body: object, payload: memoryview | None) -> object:
        msg = RecordSync.from_wire(body)  # ProtocolError: the transport closes the connection
        actions = self.sync.handle(conn.peer_id, msg, trio.current_time())
        await self._accept(actions.accept)
        if actions.reply is not None:
            try:
                await conn.send(MsgType.RECORD_SYNC, actions.reply.to_wire(), droppable=True)
            except ConnectionClosed as e:
                logger.debug("record sync reply to %s failed: %s", conn.short_id, e)
        return None

    async def _accept(self, reports: Sequence[Report]) -> None:
        """Offer reports to the store, verifying their signatures in slices that yield."""
        await offer_all(self.records, reports, now_wall=self._wall(), is_member=self._is_member)

    # ---- records and measurement

    def _publish(self, *, force: bool = False) -> None:
        """Sign and hold a new report when `report_due` says so."""
        now = trio.current_time()
        coord = self.coordinate()
        scale = statistics.median(self._rtt_seen.values()) if self._rtt_seen else 1.0
        if not report_due(self.config, self.planner, now=now, n_live=self.swim.live_count(), coord=coord,
                          rtt_scale_ms=scale, last=self._published, last_at=self._published_at,
                          last_version=self._published_version, force=force):
            return
        up, down = self.planner.capacity(now)
        self._published_version = self.planner.version
        self._published_at = now
        self._seq = max(self._seq + 1, int(self._wall() * 1000))
        report = Report.create(self.identity, self._seq, self._wall(), self.compute_ms or 0.0,
                               self.planner.entries(now), codec_ns=self.codec_ns or (),
                               coord=() if coord is None else coord.to_wire(), up_gbps=up, down_gbps=down,
                               host=self.machine, compute_share=self.compute_share)
        self._published = report
        self.records.offer(report, now_wall=self._wall(), is_member=lambda p: True)

    async def _sync_loop(self) -> None:
        while True:
            interval = self.config.record_sync_interval_s
            await trio.sleep(interval * self._rng.uniform(0.5, 1.5))
            self._publish()
            peers = [m for m in self.swim.live_members() if m.peer_id != self.identity.peer_id]
            if not peers:
                continue
            m = self._rng.choice(peers)
            now = trio.current_time()
            self.sync.tick(now)
            self._dispatch_sync(m, self.sync.start(m.peer_id, now))

    def _dispatch_sync(self, m: Member, msg: RecordSync) -> None:
        try:
            self._out_send.send_nowait(_SyncSend(m.peer_id, m.address, msg))
        except trio.WouldBlock:
            logger.warning("outgoing gossip queue full: dropping a record sync")

    def set_compute_ms(self, ms: float, share: float | None = None) -> None:
        """This peer's compute figure as its training measures it (`compute_ms` of the
        reference block, from its stage's own steps) and the share of a core its compute had
        meanwhile (CPU time over wall time; None: not measured): reported from the next report
        on when either moved by more than COMPUTE_REPUBLISH_RATIO from the one reported; a figure
        that is not a positive finite number within the record's bound is ignored, and so is a
        share outside (0, 1] (reported unknown)."""
        if not (math.isfinite(ms) and 0 < ms <= MAX_COMPUTE_MS):
            return
        new_share = share if share is not None and math.isfinite(share) and 0 < share <= 1 else 0.0
        old, old_share = self.compute_ms, self.compute_share
        self.compute_ms, self.compute_share = ms, new_share

        def moved(a: float, b: float) -> bool:
            return (a > 0) != (b > 0) or (a > 0 and max(a, b) / min(a, b) > COMPUTE_REPUBLISH_RATIO)

        if not old or moved(ms, old) or moved(new_share, old_share):
            self._published_version = -1  # (publish the figures with the next report)

    async def _measure_self(self) -> None:
        """This peer's own figures, one probe after the other (so they do not slow each
        other down), each off the event loop: the compute speed (when measuring), then the
        coding speed. A new report goes out with them."""
        if self._measure and self.compute_ms is None:
            try:
                self.compute_ms = await trio.to_thread.run_sync(self._compute_probe)
            except Exception as e:  # (reported as 0: unknown, as a peer that never measured)
                logger.warning("cannot measure this peer's compute speed: %s", e)
        if self.codec_ns is None and self._codec_probe is not None:
            try:
                self.codec_ns = check_codec_ns(tuple(await trio.to_thread.run_sync(self._codec_probe)))
            except Exception as e:  # (a failed probe leaves the figure unknown: the scheduler assumes a reference CPU)
                logger.warning("cannot measure this peer's coding speed: %s", e)
                self.codec_ns = ()
            else:
                logger.info("coding speed measured: %s ns per element",
                            "/".join(f"{v:.1f}" for v in self.codec_ns))
        self._published_version = -1  # publish the figures with the next report

    async def _measure_loop(self) -> None:
        await self._measure_self()
        me = self.identity.peer_id
        while True:
            now = trio.current_time()
            peers = [p for p in self.live_peers() if p != me]
            job = self.planner.next_job(peers, now)
            if job is None:
                wake = self.planner.wake_at(now) if peers else now + self.config.probe_interval_s
                with trio.move_on_at(max(wake, now + 1e-3)):
                    await self._wake.wait()
                if self._wake.is_set():
                    self._wake = trio.Event()
                continue
            await self._run_job(job)
            self._progress.set()
            self._progress = trio.Event()
            if job.asked:
                self._publish()

    async def _run_job(self, job: MeasureJob) -> None:
        cfg = self.config
        target = job.target
        conn = await self._link(target, self.swim.address_of(target))
        if conn is None:
            if job.kind is JobKind.LINK:
                self.planner.record(target, [], None, trio.current_time())
                await trio.sleep(cfg.probe_interval_s)
            return
        if self.gate.busy(target, trio.current_time()):
            # A big probe crosses this link: pings would queue behind its payload and
            # time the transfer, not the link. Measure it once the link is quiet.
            await trio.sleep(cfg.rtt_ping_spacing_s * self._rng.uniform(1.0, 2.0))
            return
        self.gate.probing.add(target)  # the other end's big probe waits for the pings
        replies: list[MeasurePing] = []
        try:
            samples = 1 if job.kind is JobKind.COORD else cfg.rtt_samples
            rtts = await measure_rtt(conn, samples, cfg.rtt_ping_spacing_s, cfg.measure_timeout_s, replies)
        finally:
            self.gate.probing.discard(target)
        self._observe_rtts(target, rtts, replies)
        if job.kind is JobKind.COORD:
            return
        gbps = down = None
        if rtts:
            rtt_s = sorted(rtts)[len(rtts) // 2]
            gbps = await measure_bandwidth(conn, self.gate, cfg.bandwidth_probe_bytes, rtt_s,
                                           cfg.measure_timeout_s)
            if gbps is not None and job.pull:
                down = await measure_download(conn, self.gate, cfg.bandwidth_probe_bytes, rtt_s,
                                              cfg.measure_timeout_s)
            if gbps is None:  # link busy: try again after a jittered pause
                await trio.sleep(cfg.bandwidth_probe_interval_s * self._rng.uniform(0.5, 1.5))
        self.planner.record(target, rtts, gbps, trio.current_time(), down)
        if gbps is None:
            await trio.sleep(cfg.rtt_ping_spacing_s)

    def _observe_rtts(self, target: bytes, rtts: list[float], replies: list[MeasurePing]) -> None:
        """Move this peer's coordinate by the round trips just timed (the other end's
        coordinate comes with its reply)."""
        other = next((Coordinate.from_wire(r.coord) for r in reversed(replies) if r.coord), None)
        if other is None or not rtts:
            return
        rtt_ms = statistics.median(rtts) * 1000.0
        self.vivaldi.observe(target, other, rtt_ms)
        self._rtt_seen.pop(target, None)
        self._rtt_seen[target] = rtt_ms
        while len(self._rtt_seen) > 256:
            del self._rtt_seen[next(iter(self._rtt_seen))]

    async def _measure_asked(self, targets: list[bytes], timeout_s: float) -> None:
        """Measure the links to targets now (the live ones; those measured within
        confirm_fresh_s are taken as they are) and publish a report carrying them."""
        me = self.identity.peer_id
        live = set(self.live_peers())
        targets = [t for t in targets if t != me and t in live]
        self.planner.ask(targets, trio.current_time())
        self._wake.set()
        with trio.move_on_after(timeout_s):
            while self.planner.pending(targets):
                await self._progress.wait()
        self._publish(force=True)

    async def _ask_peer(self, peer: bytes, targets: list[bytes], timeout_s: float) -> None:
        """Ask `peer` to measure its links to targets; take the signed report it answers with."""
        conn = await self._link(peer, self.swim.address_of(peer))
        if conn is None:
            return
        try:
            body, _ = await conn.request(MsgType.MEASURE_LINKS, MeasureLinks(tuple(targets)).to_wire(),
                                         timeout_s=timeout_s + self.config.measure_timeout_s)
        except (ConnectionClosed, RequestTimeout, RemoteError) as e:
            logger.debug("asking %s to measure %d links failed: %s", peer[:4].hex(), len(targets), e)
            return
        if not isinstance(body, dict) or body.get("ok") is not True or body.get("report") is None:
            return
        try:
            report = Report.from_wire(body["report"])
        except ProtocolError as e:
            logger.debug("report from %s (asked to measure): %s", peer[:4].hex(), e)
            return
        if report.measurer != peer:
            logger.debug("%s answered with a report of %s", peer[:4].hex(), report.measurer[:4].hex())
            return
        await self._accept([report])

