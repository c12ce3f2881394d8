"""The REACH probe's wire form (RUN_STATE `op: reach`: "can you reach these peers?", answered
with gossip pings): the coordinator asks the laggards of an overdue step and one end of each cut
link (control/coordinator/deadline.py, links.py; docs/control.md, "Gray failures")."""

from __future__ import annotations

from dataclasses import dataclass

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_float

__all__ = ["MAX_REACH_PEERS", "ReachAnswer", "ReachRequest"]

MAX_REACH_PEERS = 4096
MAX_REACH_TIMEOUT_S = 600.0


def _peer_list(obj: object, what: str) -> tuple[bytes, ...]:
    if not isinstance(obj, list) or len(obj) > MAX_REACH_PEERS:
        raise ProtocolError(f"{what} must be a list of at most {MAX_REACH_PEERS} peer ids")
    out = []
    for p in obj:
        if not isinstance(p, bytes) or len(p) != PEER_ID_BYTES:
            raise ProtocolError(f"{what}: a peer id must be {PEER_ID_BYTES} bytes")
        out.append(p)
    return tuple(out)


@dataclass(frozen=True)
class ReachRequest:
    """RUN_STATE `op: reach`: ping each of `peers`, each within `timeout_s`."""

    peers: tuple[bytes, ...]
    timeout_s: float

    def to_wire(self) -> dict:
        return {"op": "reach", "peers": list(self.peers), "timeout_s": self.timeout_s}

    @classmethod
    def from_wire(cls, d: dict) -> ReachRequest:
        peers = _peer_list(d.get("peers"), "reach peers")
        timeout = get_float(d, "timeout_s", 0.0, MAX_REACH_TIMEOUT_S)
        if timeout <= 0:
            raise ProtocolError("reach timeout_s must be positive")
        return cls(peers, timeout)


@dataclass(frozen=True)
class ReachAnswer:
    """Which of the asked peers answered a ping in time, and which did not."""

    reached: tuple[bytes, ...]
    unreached: tuple[bytes, ...]

    def to_wire(self) -> dict:
        return {"reached": list(self.reached), "unreached": list(self.unreached)}

    @classmethod
    def from_wire(cls, obj: object) -> ReachAnswer:
        if not isinstance(obj, dict):
            raise ProtocolError("reach answer must be a map")
        return cls(_peer_list(obj.get("reached"), "reached"), _peer_list(obj.get("unreached"), "unreached"))
