"""Settings of the coordinator election: one frozen dataclass with named profiles."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

__all__ = ["ElectionConfig"]


@dataclass(frozen=True)
class ElectionConfig:
    # A follower that hears no coordinator for a random time in [min, max] stands. Longer:
    # slower take-over after a crash; shorter than a few round trips: needless elections. The
    # spread makes two peers standing at once (a split vote) rare.
    election_timeout_min_s: float = 2.0
    election_timeout_max_s: float = 2.3
    # Each voter adds rank * stagger_s to its timeout, its rank in an order of the voters that
    # every peer of a term computes alike (a hash of term and peer id; the coordinator last),
    # so peers stand one after another instead of at once. At least a pre-vote round trip plus
    # the vote request's way (~3 one-way delays) beyond the random spread; 0: random only.
    stagger_s: float = 1.2
    # The coordinator's heartbeat period. Shorter: followers' leases and the coordinator's
    # check-quorum see a lost heartbeat sooner, at N messages per period.
    heartbeat_interval_s: float = 0.2
    # A voter that heard its coordinator within lease_s refuses to (pre-)vote for another; a
    # coordinator without acks from a quorum (certificate.quorum) within lease_s steps down. Several heartbeats
    # long, and at most election_timeout_min_s, so voters grant once a follower's timer fired.
    lease_s: float = 1.6
    # Pre-vote, leases and re-standing on a higher term; False: plain Raft (a baseline).
    pre_vote: bool = True
    # The coordinator steps down without acks from a quorum of the voters within lease_s.
    check_quorum: bool = True
    # The most a peer's term moves up on a message without a certificate for the new term (an
    # answer to its own pre-vote, vote or heartbeat, or a vote it grants). Larger: a peer that
    # fell further behind without noticing (plain Raft's inflated terms) still catches up from
    # a voter's word; smaller: a lying voter needs more messages to push terms up (reaching the
    # largest term takes it 2^63 / max_term_jump of them). A certified term is taken at any size.
    max_term_jump: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "max_term_jump":
                if type(v) is not int or not 1 <= v <= 2**32:
                    raise ValueError(f"max_term_jump must be an integer in [1, 2^32], got {v!r}")
            elif f.type in ("bool", bool):
                if type(v) is not bool:
                    raise ValueError(f"{f.name} must be a bool, got {v!r}")
            elif type(v) not in (int, float) or not 0 <= v < 1e6 or (v == 0 and f.name != "stagger_s"):
                raise ValueError(f"{f.name} must be a positive number of seconds, got {v!r}")
        if not self.election_timeout_max_s > self.election_timeout_min_s:
            raise ValueError("election_timeout_max_s must exceed election_timeout_min_s (the timeouts are random)")
        if not 3 * self.heartbeat_interval_s <= self.election_timeout_min_s:
            raise ValueError("heartbeat_interval_s must be at most a third of election_timeout_min_s")
        if not 2 * self.heartbeat_interval_s < self.lease_s <= self.election_timeout_min_s:
            raise ValueError("lease_s must exceed two heartbeat intervals and be at most election_timeout_min_s")

    @classmethod
    def wan(cls) -> ElectionConfig:
        """Peers across continents: one-way delays up to ~300 ms (the worldwide scenario)."""
        return cls()

    @classmethod
    def lan(cls) -> ElectionConfig:
        """One data centre or region: delays of a few ms."""
        return cls(election_timeout_min_s=0.5, election_timeout_max_s=0.6, heartbeat_interval_s=0.05, lease_s=0.4,
                   stagger_s=0.1)

    @classmethod
    def test(cls) -> ElectionConfig:
        """Unit tests and simulations with delays of ~10 ms."""
        return cls(election_timeout_min_s=0.3, election_timeout_max_s=0.36, heartbeat_interval_s=0.03, lease_s=0.24,
                   stagger_s=0.06)

    def with_(self, **changes) -> ElectionConfig:
        return replace(self, **changes)
