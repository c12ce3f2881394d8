"""Gossip configuration: one frozen dataclass, with named profiles (after memberlist's
DefaultLANConfig / DefaultWANConfig / DefaultLocalConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["GossipConfig"]


@dataclass(frozen=True)
class GossipConfig:
    # How often each member probes one other member. Shorter: faster detection, more traffic.
    probe_interval_s: float = 1.0
    # How long to wait for a direct ack before asking others to probe. Must exceed the RTT.
    probe_timeout_s: float = 0.5
    # Members asked to probe indirectly when a direct probe fails. More: fewer false positives.
    indirect_checks: int = 3
    # Suspicion lasts suspicion_mult * max(1, log10 N) probe intervals at least. Larger: fewer
    # false deaths, slower detection.
    suspicion_mult: float = 4.0
    # Upper bound of the suspicion timeout, as a multiple of the lower bound (Lifeguard: it
    # starts here and shrinks with independent confirmations).
    suspicion_max_timeout_mult: float = 6.0
    # Broadcasts are retransmitted retransmit_mult * ceil(log10(N + 1)) times.
    retransmit_mult: int = 4
    # Interval and fan-out of the gossip of queued broadcasts.
    gossip_interval_s: float = 0.2
    gossip_nodes: int = 3
    # Dead/left members are still gossiped to for this long (a partitioned peer can come back).
    gossip_to_dead_s: float = 30.0
    # Full-state push-pull with one random member; 0 disables. Scaled up past 32 members.
    push_pull_interval_s: float = 30.0
    # Bytes of updates in one push-pull page; a full state is sent as several pages. Keep it
    # well below the transport's max_control_frame_bytes.
    max_push_pull_bytes: int = 32 * 1024
    # Dead and left members are removed from the table this long after they went (at least
    # gossip_to_dead_s). Longer: a lagging member's stale news is recognised for longer; the
    # table of a swarm with churn grows with it.
    reap_after_s: float = 120.0
    # A removed member's last claim is kept this long more (not gossiped) so that replays and
    # stale relays of its older claims are refused, and it is sent back to that peer if it
    # rejoins from an older incarnation (so it refutes above it).
    tombstone_s: float = 3600.0
    # Members in the table at most, ourselves included; new ones beyond it are refused.
    max_members: int = 4096
    # New members one source may introduce (besides itself): a burst, then this many per second.
    # The peer we join through may hand us a whole table once.
    new_member_burst: int = 64
    new_members_per_s: float = 1.0
    # New members that may come in from one remote address (an IPv4 address, an IPv6 /64),
    # a member's claim about itself included (identities are free, addresses are not): a burst,
    # then this many per second. Many peers behind one address (one host's test swarm) join
    # at this rate once past the burst; the peer we join through is exempt while we join.
    new_member_burst_per_address: int = 64
    new_members_per_address_per_s: float = 1.0
    # Confirmed members an address group may hold besides ourselves: a cap, not a rate
    # (`caps.py`). A claim from a group at its cap is refused, and so is a confirmation that
    # would pass it. per_address: an IPv4 address or an IPv6 /64 (one host, or a few behind
    # one NAT; several daemons per host, one a GPU, fit). per_ipv6_48: an IPv6 /48 (one site:
    # a holder of a /48 has 65,536 /64s). per_loopback: every loopback address together, this
    # host: the test swarms of `dtfm-swarm` run up to 64 daemons on 127.0.0.1; a local
    # process holding the swarm key makes at most this many members. Lower: fewer sybils per
    # address; higher: more honest daemons behind one address.
    max_members_per_address: int = 16
    max_members_per_ipv6_48: int = 64
    max_members_per_loopback: int = 64
    # A new member counts as alive (in live_peers, the view, the scheduler) only once it has
    # acked a ping sent over a connection that we dialled to the address it claims, whose
    # handshake proved its identity. At most max_verifying such pings are in flight; each
    # (dial, handshake, ack) must finish within verify_timeout_s, and a member is tried
    # verify_attempts times before only the regular probes are left to it.
    # A member's regular probes verify it as well while it is unconfirmed.
    max_verifying: int = 16
    verify_timeout_s: float = 1.0
    verify_attempts: int = 4
    # A claim may raise a known member's incarnation by at most this much (a peer refutes with
    # +1; a restarted peer jumps to one past what the swarm holds).
    max_incarnation_jump: int = 1 << 20
    # Lifeguard local health: probe interval and timeout stretch up to this factor when this
    # member itself seems slow (missed nacks, refutations).
    awareness_max_multiplier: int = 8
    # Bytes of piggybacked membership updates per message.
    max_piggyback_bytes: int = 1200
    # Measurement: pings per RTT estimate, spacing, and per-ping timeout.
    rtt_samples: int = 5
    rtt_ping_spacing_s: float = 0.05
    measure_timeout_s: float = 5.0
    # Bandwidth probe: bytes per timed transfer and minimum spacing between two big probes
    # from this member (rate limit), jittered by +-jitter fraction.
    bandwidth_probe_bytes: int = 1 << 20
    bandwidth_probe_interval_s: float = 2.0
    measure_jitter: float = 0.25
    # Re-measure a link after this long.
    remeasure_interval_s: float = 600.0
    # Up to this many other live peers, every link is measured (round trips and a timed
    # transfer), as all-pairs measurement always did: the view holds measured figures only.
    # Past it a peer measures links to capacity_peers random peers (its upload and download
    # capacity) and the links asked for (`GossipService.confirm`), and the view estimates the
    # rest. Higher: a measured matrix for larger swarms, at N big probes per peer.
    full_mesh_max_peers: int = 16
    capacity_peers: int = 3
    # One round trip to a random peer this often (four times as often for the first 32), for
    # the network coordinate (Vivaldi); the coordinate goes into the report once it has
    # coord_min_samples samples behind it. Lower: a joiner is placed sooner, on a rougher
    # coordinate.
    coord_interval_s: float = 1.0
    coord_min_samples: int = 16
    # A link asked for is not measured again within this long; a report keeps carrying it
    # that long.
    confirm_fresh_s: float = 120.0
    # How long a peer asked to measure links (a plan's) may take before it answers.
    confirm_timeout_s: float = 60.0
    # Links a report carries at most (asked for first, then the most recent): a report's
    # size does not grow with the swarm. At least full_mesh_max_peers.
    max_report_links: int = 64
    # A new report goes out when the coordinate moved by more than this fraction of the
    # median round trip this peer sees, or a capacity by more than capacity_republish_ratio,
    # or the links it carries changed; and at least every report_refresh_s, or every half
    # record_skew_s if that is shorter (so that a joiner takes every live peer's report).
    coord_republish_fraction: float = 0.25
    capacity_republish_ratio: float = 1.25
    report_refresh_s: float = 300.0
    # Own measurement report is re-signed and published at most this often
    # (x max(1, N / 16) past 16 peers; a report that became ready to schedule with goes at once).
    publish_interval_s: float = 2.0
    # Record anti-entropy (digest push-pull) with one random member.
    record_sync_interval_s: float = 2.0
    # An exchange that has not moved on for this long is dropped. It must exceed a round trip
    # plus the transfer of max_sync_bytes; a late reply after it is ignored (the next round
    # repairs what it would have).
    record_sync_timeout_s: float = 10.0
    # Records whose timestamp is further than this from our clock are refused.
    record_skew_s: float = 600.0
    # Upper bound of the bytes of records sent in one sync message; keep it well below the
    # transport's max_control_frame_bytes.
    max_sync_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{f.name} must be a finite number, got {v!r}")
            if v < 0:
                raise ValueError(f"{f.name} must be non-negative, got {v}")
        if self.probe_interval_s <= 0 or self.gossip_interval_s <= 0:
            raise ValueError("probe_interval_s and gossip_interval_s must be positive")
        if not 0 < self.probe_timeout_s <= self.probe_interval_s:
            raise ValueError("probe_timeout_s must be positive and at most probe_interval_s")
        if self.suspicion_max_timeout_mult < 1:
            raise ValueError("suspicion_max_timeout_mult must be >= 1")
        if self.awareness_max_multiplier < 1:
            raise ValueError("awareness_max_multiplier must be >= 1")
        if self.rtt_samples < 1 or self.bandwidth_probe_bytes < 1:
            raise ValueError("rtt_samples and bandwidth_probe_bytes must be >= 1")
        if not 0 <= self.measure_jitter < 1:
            raise ValueError("measure_jitter must be in [0, 1)")
        if self.reap_after_s < self.gossip_to_dead_s:
            raise ValueError("reap_after_s must be at least gossip_to_dead_s")
        if self.max_push_pull_bytes < 1024 or self.max_piggyback_bytes < 512:
            raise ValueError("max_push_pull_bytes must be >= 1024 and max_piggyback_bytes >= 512")
        if self.max_verifying < 1 or self.verify_timeout_s <= 0 or self.verify_attempts < 1:
            raise ValueError("max_verifying and verify_attempts must be >= 1, verify_timeout_s positive")
        if min(self.max_members_per_address, self.max_members_per_ipv6_48, self.max_members_per_loopback) < 1:
            raise ValueError("max_members_per_address, max_members_per_ipv6_48 and max_members_per_loopback "
                             "must be >= 1")
        if self.max_members < 2 or self.max_incarnation_jump < 1:
            raise ValueError("max_members must be >= 2 and max_incarnation_jump >= 1")
        if self.max_report_links < self.full_mesh_max_peers or self.max_report_links > 4096:
            raise ValueError("max_report_links must be at least full_mesh_max_peers and at most 4096")
        if self.coord_interval_s <= 0 or self.coord_min_samples < 1 or self.capacity_republish_ratio < 1:
            raise ValueError("coord_interval_s must be positive, coord_min_samples >= 1, "
                             "capacity_republish_ratio >= 1")
        if not self.report_refresh_s > 0:
            raise ValueError("report_refresh_s must be positive")
        if self.record_sync_interval_s <= 0 or self.publish_interval_s <= 0 or self.record_sync_timeout_s <= 0:
            raise ValueError("record_sync_interval_s, record_sync_timeout_s and publish_interval_s must be positive")

    @classmethod
    def lan(cls) -> "GossipConfig":
        """Defaults for one data centre (memberlist's DefaultLANConfig)."""
        return cls()

    @classmethod
    def wan(cls) -> "GossipConfig":
        """Links with hundreds of ms of latency (memberlist's DefaultWANConfig)."""
        return cls(probe_interval_s=5.0, probe_timeout_s=3.0, suspicion_mult=6.0,
                   gossip_interval_s=0.5, gossip_nodes=4, push_pull_interval_s=60.0,
                   measure_timeout_s=10.0, verify_timeout_s=5.0)

    @classmethod
    def local(cls) -> "GossipConfig":
        """One machine, loopback (memberlist's DefaultLocalConfig)."""
        return cls(probe_interval_s=1.0, probe_timeout_s=0.2, suspicion_mult=3.0,
                   gossip_interval_s=0.1, push_pull_interval_s=15.0,
                   bandwidth_probe_interval_s=0.5)

    @classmethod
    def test(cls) -> "GossipConfig":
        """Small, quick swarms in tests under MockClock."""
        return cls(push_pull_interval_s=10.0, bandwidth_probe_bytes=64 * 1024,
                   bandwidth_probe_interval_s=0.2, rtt_samples=3, publish_interval_s=1.0,
                   record_sync_interval_s=1.0, max_sync_bytes=32 * 1024)

    def refresh_s(self) -> float:
        """How old a peer's own report may grow before it signs a new one regardless."""
        return min(self.report_refresh_s, self.record_skew_s / 2)

    def with_(self, **changes: Any) -> "GossipConfig":
        return replace(self, **changes)

    # Derived figures, after memberlist's util.go.

    def retransmit_limit(self, n_members: int) -> int:
        return int(self.retransmit_mult * math.ceil(math.log10(n_members + 1)))

    def suspicion_min_s(self, n_members: int) -> float:
        node_scale = max(1.0, math.log10(max(1.0, float(n_members))))
        return self.suspicion_mult * node_scale * self.probe_interval_s

    def suspicion_max_s(self, n_members: int) -> float:
        return self.suspicion_max_timeout_mult * self.suspicion_min_s(n_members)

    def push_pull_scaled_s(self, n_members: int) -> float:
        """Push-pull interval, stretched logarithmically past 32 members (memberlist)."""
        if n_members <= 32:
            return self.push_pull_interval_s
        return self.push_pull_interval_s * (1 + math.ceil(math.log2(n_members) - math.log2(32)))
