"""Daemon messages between peers: address exchange, goodbye, and "what address do you see me
at".

Message types 16-31 of dtfm.peer's range belong to the daemon. ONLY APPEND TO THIS ENUM.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from dtfm.net import (
    MAX_HOST_LEN,
    PEER_ID_BYTES,
    Address,
    AddressError,
    ProtocolError,
    get_bool,
    get_bytes,
    get_dict,
    get_int,
    get_list,
    get_str,
)

MAX_EXCHANGE_PEERS = 1024
MAX_REGION_LEN = 64
MAX_REASON_LEN = 200


class DaemonMsg(IntEnum):
    PEER_EXCHANGE = 16  # request: our connected peers; reply: theirs
    LEAVING = 17        # one-way: the sender is leaving the swarm
    ADDRESS_QUERY = 18  # request: the port the sender listens on; reply: where it was seen


@dataclass(frozen=True)
class PeerRecord:
    """A peer's id and the address others can dial it at."""

    peer_id: bytes
    address: Address
    region: str

    def to_wire(self) -> dict:
        return {"id": self.peer_id, "host": self.address.host, "port": self.address.port,
                "region": self.region}

    @classmethod
    def from_wire(cls, obj: object) -> "PeerRecord":
        d = get_dict(obj, "peer record")
        peer_id = get_bytes(d, "id", PEER_ID_BYTES, PEER_ID_BYTES)
        host = get_str(d, "host", MAX_HOST_LEN)
        port = get_int(d, "port", 1, 65535)
        region = get_str(d, "region", MAX_REGION_LEN)
        try:
            address = Address(host, port)
        except AddressError as e:
            raise ProtocolError(f"peer record: {e}") from None
        if address.is_unspecified:
            raise ProtocolError(f"peer record: unspecified host {host!r} cannot be dialled")
        return cls(peer_id, address, region)


@dataclass(frozen=True)
class PeerExchange:
    """Body of a PEER_EXCHANGE request and of its reply."""

    peers: tuple[PeerRecord, ...]

    def to_wire(self) -> dict:
        return {"peers": [p.to_wire() for p in self.peers]}

    @classmethod
    def from_wire(cls, obj: object, *, max_peers: int = MAX_EXCHANGE_PEERS) -> "PeerExchange":
        items = get_list(get_dict(obj, "peer exchange"), "peers", max_peers)
        return cls(tuple(PeerRecord.from_wire(item) for item in items))


@dataclass(frozen=True)
class Leaving:
    """Body of a LEAVING message."""

    reason: str

    def to_wire(self) -> dict:
        return {"reason": self.reason[:MAX_REASON_LEN]}

    @classmethod
    def from_wire(cls, obj: object) -> "Leaving":
        return cls(get_str(get_dict(obj, "leaving"), "reason", MAX_REASON_LEN))


@dataclass(frozen=True)
class AddressQuery:
    """Body of an ADDRESS_QUERY request: "what address do you see me at?". The sender claims
    the port it listens on; the answering peer dials that port on the host the connection came
    from before it confirms."""

    port: int

    def to_wire(self) -> dict:
        return {"port": self.port}

    @classmethod
    def from_wire(cls, obj: object) -> "AddressQuery":
        return cls(get_int(get_dict(obj, "address query"), "port", 1, 65535))


@dataclass(frozen=True)
class AddressSeen:
    """Reply to an ADDRESS_QUERY: the host the asker's connection came from, the port it
    claimed, and whether a dial there reached the asker (same verified peer id)."""

    address: Address
    confirmed: bool

    def to_wire(self) -> dict:
        return {"host": self.address.host, "port": self.address.port,
                "confirmed": self.confirmed}

    @classmethod
    def from_wire(cls, obj: object) -> "AddressSeen":
        d = get_dict(obj, "address seen")
        host = get_str(d, "host", MAX_HOST_LEN)
        port = get_int(d, "port", 1, 65535)
        confirmed = get_bool(d, "confirmed")
        try:
            address = Address(host, port)
        except AddressError as e:
            raise ProtocolError(f"address seen: {e}") from None
        return cls(address, confirmed)


def dialable_address(advertised: tuple[str, int], remote: tuple[str, int]) -> Address | None:
    """Where to dial a connected peer: its advertised listen address, with an unspecified host
    (0.0.0.0, ::) replaced by the address its connection came from. None if it has no port."""
    host, port = advertised
    if not port:
        return None
    try:
        address = Address(host or remote[0], port)
        if address.is_unspecified:
            address = Address(remote[0], port)
    except AddressError:
        return None
    return address
